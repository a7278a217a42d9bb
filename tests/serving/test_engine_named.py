"""The engine that served a request, named in each response (`system_fingerprint`, `speculation.engine`, the
`X-Specdecode-Engine` header), and `speculation.engine`, which pins one: on a server around a router of two tiny
engines with different weights (so that a pin shows in the text), and around one plain Engine."""

import json

import openai
import pytest

from helpers import LiveServer, http
from specdecode.planning.costs import CostModel
from specdecode.routing import Router
from specdecode.server import create_app, engine_lock
from tiny import build_engine

MODEL = "tiny"
# llama.cpp's Q4 on a CPU: cheap plain steps; torch bf16 with AMX: plain steps three times dearer, flat passes
STEEP = CostModel({1: 1.0, 2: 1.53, 4: 1.53, 8: 2.97, 16: 3.39, 32: 6.1, 64: 12.2}, {})
FLAT = CostModel({1: 3.0, 2: 3.0, 4: 3.05, 8: 3.1, 16: 3.2, 32: 3.6, 64: 4.5}, {})

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


@pytest.fixture(scope="module")
def router():
    r = Router.__new__(Router)  # the names a server knows, hand-made costs, no timing
    r.engines = {
        "llama.cpp": build_engine(0, None, costs=STEEP, progress=False),
        "torch": build_engine(2, None, costs=FLAT, progress=False),
    }
    r.primary = r.engines["llama.cpp"]
    r.read_s = {"llama.cpp": 0.12, "torch": 0.03}  # torch reads prompts 4x faster
    r.choices = {name: 0 for name in r.engines}
    return r


@pytest.fixture(scope="module")
def routed(router):
    srv = LiveServer(create_app(router, model_id=MODEL, method="autoregressive", gamma=1))
    yield srv
    srv.stop()


def alone(srv, engine, prompt, n):
    srv.wait_idle()
    with engine_lock(engine):
        return engine.generate(prompt, method="autoregressive", max_new_tokens=n).text


def post(srv, prompt, n, **speculation):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n}
    if speculation:
        body["speculation"] = speculation
    return http.post(f"{srv.url}/v1/completions", json=body, timeout=60)


def named(r) -> str:
    """The engine a 200 response names, checked to be the same in its three places."""
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"] == body["speculation"]["engine"] == r.headers["x-specdecode-engine"]
    return body["system_fingerprint"]


def test_each_response_names_its_engine_and_a_request_can_pin_one(routed, router):
    default = post(routed, "hi", 12)
    assert named(default) == "llama.cpp"  # a short chat stays on the cheap plain step
    pinned = post(routed, "hi", 12, engine="torch")
    assert named(pinned) == "torch"
    assert pinned.json()["choices"][0]["text"] == alone(routed, router.engines["torch"], "hi", 12)
    assert default.json()["choices"][0]["text"] == alone(routed, router.engines["llama.cpp"], "hi", 12)
    assert pinned.json()["choices"][0]["text"] != default.json()["choices"][0]["text"]


def test_max_tokens_does_not_move_a_request_to_another_engine(routed):
    """Priced with its cap, this prompt's read would decide a 2-token request (torch) and its decoding a 40-token one
    (llama.cpp); the same request cut shorter must run on the same engine."""
    prompt = "x = 1\n" * 34
    assert {named(post(routed, prompt, n)) for n in (2, 40)} == {"llama.cpp"}


def test_a_stream_names_its_engine_in_every_chunk_and_its_headers(routed, router):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
        "speculation": {"engine": "torch"},
    }
    with http.stream("POST", f"{routed.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-specdecode-engine"] == "torch"
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3 and {c["system_fingerprint"] for c in chunks} == {"torch"}
    assert chunks[-1]["speculation"]["engine"] == "torch"


def test_the_openai_client_reads_the_engine(routed):
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model=MODEL,
        max_tokens=6,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"speculation": {"engine": "torch"}},
    )
    assert out.system_fingerprint == "torch" and out.model_extra["speculation"]["engine"] == "torch"
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=6, stream=True))
    assert {c.system_fingerprint for c in chunks} == {"llama.cpp"}


@pytest.mark.parametrize(
    "speculation, message",
    [
        ({"engine": "vllm"}, "speculation.engine: Input should be 'llama.cpp' or 'torch'"),
        ({"engine": "torch", "method": "draft"}, "engine 'torch' cannot run method 'draft'"),
    ],
)
def test_an_engine_that_cannot_serve_the_request_is_a_400_naming_the_field(routed, speculation, message):
    r = post(routed, "hi", 4, **speculation)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "speculation.engine" and err["message"].startswith(message)


def test_a_server_of_one_engine_names_it_and_refuses_a_pin_to_another(tiny_engine):
    srv = LiveServer(create_app(tiny_engine, model_id=MODEL, method="autoregressive", gamma=1))
    try:
        assert named(post(srv, "hi", 4)) == "torch" == named(post(srv, "hi", 4, engine="torch"))
        r = post(srv, "hi", 4, engine="llama.cpp")
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.engine"
        assert r.json()["error"]["message"] == "speculation.engine is 'llama.cpp', but this server runs 'torch'"
    finally:
        srv.stop()


def test_a_server_on_batch_slots_names_the_engine_of_the_slot_that_ran_it(tmp_path):
    """A request opened on the engine runs on a slot's Engine (opened again there): that one's answer names it too."""
    pytest.importorskip("llama_cpp")
    from specdecode import Engine
    from specdecode.backends.llamacpp import LlamaLM
    from specdecode.slots import Slots
    from tiny import byte_tokenizer
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", 0, hidden=128)
    e = Engine(LlamaLM(gguf, threads=1), byte_tokenizer())
    e.progress = False
    srv = LiveServer(create_app(e, model_id=MODEL, method="autoregressive", gamma=1, slots=Slots(e, 2)))
    try:
        assert named(post(srv, "hi", 4)) == "llama.cpp"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
        with http.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.headers["x-specdecode-engine"] == "llama.cpp" and chunks[-1]["speculation"]["engine"] == "llama.cpp"
    finally:
        srv.stop()
