"""A prediction through the real server on the tiny models: OpenAI's usage fields with exact counts (read by the
official client, streamed and not), the same counts from the Engine and the CLI, and the prediction's limits and bad
input (a 400 naming it, before tokenizing where its length already says so), tokenized once per request.

The character tokenizer makes each character one token that encodes back to itself, so a prediction written from
the plain answer's text has known tokens, and greedy output never depends on the prediction."""

from __future__ import annotations

import json

import openai
import pytest

from helpers import LiveServer, http
from specdecode.planning.costs import CostModel
from specdecode.server import create_app
from tiny import build_engine, char_tokenizer

XEON = CostModel({1: 1.0, 2: 1.53, 3: 2.08, 4: 1.53, 8: 2.97, 16: 3.39, 32: 6.10, 64: 12.2}, {})
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "fix the typo: def add(a, b):\n    retrun a + b\n"}]
N = 48  # tokens of the plain answer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


@pytest.fixture(scope="module")
def engine():
    return build_engine(0, tokenizer=char_tokenizer(), costs=XEON, progress=False)


@pytest.fixture(scope="module")
def live(engine):
    srv = LiveServer(create_app(engine, model_id=MODEL, method="auto"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def answer(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "length" and len(text) == N  # one token a character
    return text


def absent(text: str, n: int) -> str:
    """n characters of the tokenizer that the text does not hold (they can never be aligned with it)."""
    chars = [c for c in map(chr, range(0x391, 0x391 + 160)) if c not in text]
    return "".join(chars[:n])


def ask(client, prediction: str, max_tokens: int = N, stream: bool = False, **kw):
    """(text, completion_tokens, accepted, rejected) of the chat request, and the speculation stats."""
    args = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        prediction={"type": "content", "content": prediction},
        **kw,
    )
    if not stream:
        out = client.chat.completions.create(**args)
        d = out.usage.completion_tokens_details
        return (
            out.choices[0].message.content,
            out.usage.completion_tokens,
            d.accepted_prediction_tokens,
            d.rejected_prediction_tokens,
        )
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    d = last.usage.completion_tokens_details
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, last.usage.completion_tokens, d.accepted_prediction_tokens, d.rejected_prediction_tokens


def edits(text: str) -> dict[str, tuple[str, int, int]]:
    """prediction, accepted, rejected for an answer cut at N tokens (max_tokens): the answer is `text`."""
    x = absent(text, 30)
    return {
        "insertion": (text[:20] + text[24:], 44, 0),  # the answer inserts 4 tokens: all 44 predicted ones appear
        "deletion": (text[:20] + x[:4] + text[20:], 48, 4),  # it leaves 4 out
        "substitution": (text[:20] + x[:2] + text[22:], 46, 2),  # it changes 2
        "wrong": (x, 0, 30),  # none appears; each of the 48 tokens could have been one of the prediction's 30
        "copy": (text, 48, 0),
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("edit", ["insertion", "deletion", "substitution", "wrong", "copy"])
def test_the_usage_counts_the_prediction_along_the_answer(client, answer, edit, stream):
    prediction, accepted, rejected = edits(answer)[edit]
    assert ask(client, prediction, stream=stream) == (answer, N, accepted, rejected)


def test_max_tokens_shorter_than_the_prediction_counts_what_the_answer_could_reach(client, answer):
    # a copy cut at 20 tokens: the prediction's other 28 were never reached, so none of them is rejected
    assert ask(client, answer, max_tokens=20) == (answer[:20], 20, 20, 0)
    x = absent(answer, 1)
    assert ask(client, answer[:5] + x + answer[6:], max_tokens=20, stream=True) == (answer[:20], 20, 19, 1)


def test_an_answer_that_ends_on_its_own_counts_the_whole_prediction(client, answer):
    """A stop string ends the answer: every predicted token it does not hold is rejected (its stop's tokens count,
    as completion_tokens counts them)."""
    k = next(i for i in range(10, N) if answer[i] not in answer[:i])  # a character first seen at k
    text, tokens, accepted, rejected = ask(client, answer, stop=[answer[k]])
    assert (text, tokens, accepted, rejected) == (answer[:k], k + 1, k + 1, N - k - 1)


def test_the_engine_and_the_cli_report_the_same_counts(engine, answer, tiny_dirs, tmp_path, capsys):
    messages = [{"role": "user", "content": MESSAGES[0]["content"]}]
    prediction, accepted, rejected = edits(answer)["deletion"]
    out = engine.generate(messages, max_new_tokens=N, prediction=prediction)
    assert (out.text, out.stats.accepted_prediction_tokens, out.stats.rejected_prediction_tokens) == (
        answer,
        accepted,
        rejected,
    )
    assert (
        out.as_dict()["stats"]["accepted_prediction_tokens"],
        out.as_dict()["stats"]["rejected_prediction_tokens"],
    ) == (accepted, rejected)

    from specdecode.cli import main
    from specdecode.prediction import prediction_usage

    target, draft = tiny_dirs  # (byte tokenizer: the counts are checked against the tokens it wrote)
    pred = tmp_path / "pred.txt"
    pred.write_text("def add(a, b):\n    return a + b\n")
    base = [
        "generate",
        "def add(a, b):",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--backend",
        "torch",
        "--method",
        "lookup",
        "--max-new-tokens",
        "24",
        "--prediction",
        str(pred),
    ]
    assert main(base + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    predicted = list(pred.read_bytes())  # one token a byte
    counts = prediction_usage(predicted, got["token_ids"], finished=got["stats"]["finish_reason"] != "length")
    assert (got["stats"]["accepted_prediction_tokens"], got["stats"]["rejected_prediction_tokens"]) == counts
    assert main(base) == 0
    assert f"prediction: {counts[0]} tokens accepted, {counts[1]} rejected" in capsys.readouterr().err


# -- limits and bad input ---------------------------------------------------------------------------------------------
def post(live, prediction, **kw):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "prediction": prediction, **kw}
    return http.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)


@pytest.fixture
def encodings(live, engine, monkeypatch):
    """The texts the server tokenizes as a prediction."""
    calls = []
    encode = engine.encode_prediction

    def counting(prediction):
        if isinstance(prediction, str):
            calls.append(prediction)
        return encode(prediction)

    live.wait_idle()
    monkeypatch.setattr(engine, "encode_prediction", counting)
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_prediction_longer_than_the_context_is_a_400_naming_it(live, engine, encodings, stream):
    context = engine.target.max_length  # 512 tokens
    # no token covers more than 13 characters ("<|endoftext|>"): 13 x 512 characters cannot fit, refused untokenized
    r = post(live, {"type": "content", "content": "x" * (13 * context + 1)}, stream=stream)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prediction" and err["code"] == "context_length_exceeded" and encodings == []
    r = post(
        live,
        {"type": "content", "content": [{"type": "text", "text": "y" * context}, {"type": "text", "text": "z"}]},
        stream=stream,
    )
    assert r.status_code == 400, r.text  # 513 tokens, found once tokenized
    err = r.json()["error"]
    assert err["param"] == "prediction" and f"{context + 1} tokens" in err["message"]
    assert post(live, {"type": "content", "content": "y" * context}).status_code == 200  # the whole context: fine


def test_a_lone_surrogate_in_the_prediction_is_a_400_naming_it(live, encodings):
    for content in ('"a\\ud800b"', '[{"type": "text", "text": "\\udc00"}]'):
        raw = (
            '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
            '"prediction": {"type": "content", "content": %s}}' % content
        ).encode()
        r = http.post(
            f"{live.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prediction" and "surrogate" in err["message"]
    assert encodings == []
    paired = (
        b'{"model": "tiny", "max_tokens": 2, "prompt": "hi", "prediction": {"type": "content", '
        b'"content": "\\ud83d\\ude00"}}'
    )  # a pair is one character (not in this vocabulary: no token)
    assert (
        http.post(
            f"{live.url}/v1/completions", content=paired, headers={"content-type": "application/json"}, timeout=60
        ).status_code
        == 200
    )


@pytest.mark.parametrize("chat, stream", [(False, False), (True, True)])
def test_the_prediction_is_tokenized_once(live, encodings, answer, chat, stream):
    body = {"model": MODEL, "max_tokens": 4, "stream": stream, "prediction": {"type": "content", "content": answer}}
    body.update({"messages": MESSAGES} if chat else {"prompt": "once"})
    r = http.post(f"{live.url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=60)
    assert r.status_code == 200 and encodings == [answer]


@pytest.mark.parametrize("method", ["pld", "auto"])
def test_the_bodys_prediction_reaches_the_drafter_tokenized_once(live, engine, answer, monkeypatch, method):
    """From the HTTP body to the drafter: the tokenizer reads the prompt and the prediction once each (whatever copy
    of it the server encodes on), and the drafter gets those tokens."""
    import dataclasses

    from specdecode.methods import METHOD_TABLE

    texts, drafted_from = [], []
    tokenizer = type(engine.tokenizer)
    call = tokenizer.__call__
    monkeypatch.setattr(
        tokenizer, "__call__", lambda self, text, *a, **kw: texts.append(text) or call(self, text, *a, **kw)
    )
    build = METHOD_TABLE[method].build
    monkeypatch.setitem(
        METHOD_TABLE,
        method,
        dataclasses.replace(
            METHOD_TABLE[method],
            build=lambda parts, request: drafted_from.append(request.prediction_ids) or build(parts, request),
        ),
    )
    live.wait_idle()
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "prompt": "once",
        "speculation": {"method": method},
        "prediction": {"type": "content", "content": answer},
    }
    r = http.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(texts) == sorted(["once", answer])
    assert drafted_from == [tuple(call(engine.tokenizer, answer, add_special_tokens=False)["input_ids"])]


def test_a_batch_slot_opens_the_request_again_without_tokenizing_the_prediction(engine, encodings, answer):
    """Where batch slots run requests, the slot's Engine opens the request again (stream.reopen): with its tokens."""
    import anyio

    from specdecode.server import protocol as p

    service = create_app(engine, model_id=MODEL, method="auto").state.service
    _, chat = p.request_models(service.cap)
    body = chat.model_validate_json(
        json.dumps(
            {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": 4,
                "prediction": {"type": "content", "content": answer},
            }
        )
    )
    stream = anyio.run(service.open, body, "chat", [m.as_engine_message() for m in body.messages])
    again = stream.reopen(engine)
    assert encodings == [answer] and again.prediction_ids == stream.prediction_ids == tuple(
        engine.encoder(answer, add_special_tokens=False)["input_ids"]
    )


def test_batch_slots_count_the_prediction_as_the_engine_alone(tmp_path, monkeypatch):
    """On llama.cpp batch slots: the request's counts are those of the same generation alone, its prediction
    tokenized once (the slot's Engine opens the request again with its tokens)."""
    pytest.importorskip("llama_cpp")
    from specdecode import Engine
    from specdecode.backends.llamacpp import LlamaLM
    from specdecode.slots import Slots
    from tiny import byte_tokenizer
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", 0, hidden=128)
    tok = byte_tokenizer()
    e = Engine(LlamaLM(gguf, threads=1), tok, LlamaLM(gguf, threads=1), tok)
    e.progress = False
    plain = e.generate("abcabcabc abc", method="pld", max_new_tokens=24)
    prediction = "abc abc" + plain.text[4:]  # a changed start, then the answer
    alone = e.generate("abcabcabc abc", method="pld", max_new_tokens=24, prediction=prediction)
    slots = Slots(e, 2)
    texts = []
    for engine in [e, *slots.engines]:
        encode = engine.encode_prediction
        monkeypatch.setattr(
            engine,
            "encode_prediction",
            lambda x, encode=encode: (texts.append(x) if isinstance(x, str) else None) or encode(x),
        )
    live = LiveServer(create_app(e, model_id=MODEL, method="pld", slots=slots))
    try:
        r = http.post(
            f"{live.url}/v1/completions",
            timeout=60,
            json={
                "model": MODEL,
                "prompt": "abcabcabc abc",
                "max_tokens": 24,
                "temperature": 0,
                "prediction": {"type": "content", "content": prediction},
            },
        )
    finally:
        live.stop()
    assert r.status_code == 200, r.text
    d = r.json()["usage"]["completion_tokens_details"]
    assert r.json()["choices"][0]["text"] == alone.text and texts == [prediction]
    assert (d["accepted_prediction_tokens"], d["rejected_prediction_tokens"]) == (
        alone.stats.accepted_prediction_tokens,
        alone.stats.rejected_prediction_tokens,
    )
    assert alone.stats.accepted_prediction_tokens > 0
