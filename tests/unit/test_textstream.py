"""Incremental detokenization (engine.TextStream): the deltas of a stream are the text of its ids, for a
byte-level tokenizer, a SentencePiece-style one (leading-space pieces, byte fallback) and ids that went
through a real chat template, with multi-byte characters split across tokens and steps; stop strings are
applied as the whole-text algorithm applied them; and the work is linear in the output length."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdecode import Engine, SpecDecodeError, Stats
from specdecode.textstream import TextStream
from tiny import byte_tokenizer

TEXT = "Hello world: naïve café, ünïcödé — 日本語のテキスト 🙂👍🏽 and 😀 again.\ndef f(x):\n    return x ** 2  # ½ ≤ ∞"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sentencepiece_tokenizer(decoder: str = "llama") -> PreTrainedTokenizerFast:
    """A Unigram model with SentencePiece's conventions: '▁' marks a space (one prepended to the text),
    whole-word pieces, and byte fallback (<0xE6>...) for characters it does not know, so most non-ASCII
    characters are split into byte tokens. decoder "llama": Replace + ByteFallback + Fuse + Strip (Llama 2's);
    "metaspace": ByteFallback + Metaspace."""
    pieces = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁Hello", "▁world", "▁and", "▁again", "▁return", "▁def", "▁naïve", "▁the", "▁", "ll", "or", "é", "日本"]
    pieces += words + sorted({c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:,.#*()\n"})
    vocab = [(p, -1.0 if p in words else -5.0) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if decoder == "llama":
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    return fast


TOKENIZERS = {
    "byte-level": byte_tokenizer,
    "sentencepiece-llama": lambda: sentencepiece_tokenizer("llama"),
    "sentencepiece-metaspace": lambda: sentencepiece_tokenizer("metaspace"),
}


class Counting:
    """Engine.decode on a tokenizer, counting the ids it decodes."""

    def __init__(self, tok):
        self.engine = SimpleNamespace(tokenizer=tok)
        self.tokenizer = tok  # as an Engine's: TextStream reads how it decodes
        self.ids = 0

    def decode(self, ids):
        self.ids += len(ids)
        return Engine.decode(self.engine, ids)


def steps(ids: list[int], seed: int, most: int = 5):
    """ids cut into steps of 1..most tokens, as the loop commits them."""
    rng = random.Random(seed)
    i = 0
    while i < len(ids):
        n = rng.randint(1, most)
        yield ids[i : i + n]
        i += n


def run(tok, ids, seed=0, stops=(), most=5):
    counting = Counting(tok)
    stream = TextStream(counting, steps(ids, seed, most), Stats(), list(stops))
    deltas = list(stream)
    return deltas, stream.result, counting


def whole_text_reference(decode, ids, chunks, stops):
    """The previous TextStream: decodes all ids at every step (quadratic); the reference for stop strings."""
    out, sent, finish = [], "", None
    acc: list[int] = []
    for new in chunks:
        acc += new
        text = decode(acc)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        cut = min(hits) if hits else None
        if cut is not None:
            text = text[:cut]
            k = len(acc)
            while k > 1 and any(s in decode(acc[: k - 1]) for s in stops):
                k -= 1
            acc, finish, safe = acc[:k], "stop", len(text)
        else:
            safe = len(text)
            while safe and text[safe - 1] == "\ufffd":
                safe -= 1
            for s in stops:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:k]):
                        safe -= k
                        break
        if safe > len(sent):
            out.append(text[len(sent) : safe])
            sent = text[:safe]
        if cut is not None:
            break
    text = decode(acc) if finish != "stop" else sent
    if len(text) > len(sent) and text.startswith(sent):
        out.append(text[len(sent) :])
    return out, text, acc


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", range(4))
def test_deltas_are_the_text_of_all_ids(name, seed):
    tok = TOKENIZERS[name]()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT) // 2  # many characters come as several tokens
    deltas, result, _ = run(tok, ids, seed)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == result.text == full
    assert full.strip() == TEXT.strip()
    assert not any("\ufffd" in d for d in deltas)  # a character split across tokens is never split in the stream


@pytest.mark.parametrize("name", TOKENIZERS)
def test_one_token_per_step_holds_back_split_characters(name):
    tok = TOKENIZERS[name]()
    ids = tok("😀é日本🙂", add_special_tokens=False)["input_ids"]
    assert len(ids) > 5
    deltas, result, _ = run(tok, ids, most=1)
    assert result.text == tok.decode(ids, skip_special_tokens=True) == "".join(deltas)
    assert len(deltas) < len(ids) and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", ["sentencepiece-llama", "sentencepiece-metaspace"])
def test_leading_space_pieces_keep_their_space(name):
    """SentencePiece decoders drop the space of the first piece of whatever they decode: a stream that
    decoded each step's tokens alone would lose the spaces between words."""
    tok = TOKENIZERS[name]()
    ids = tok("Hello world and again", add_special_tokens=False)["input_ids"]
    deltas, result, _ = run(tok, ids, most=1)
    assert deltas == ["Hello", " world", " and", " again"] and result.text == "Hello world and again"


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece-llama"])
def test_through_a_chat_template(name):
    """A whole ChatML conversation (special tokens included, which decode skips) as the 'output'."""
    tok = TOKENIZERS[name]()
    if tok.chat_template != CHATML:  # the byte-level tokenizer: give it ChatML's special tokens
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHATML
    messages = [
        {"role": "system", "content": "Réponds en français 🙂"},
        {"role": "user", "content": "日本語で？ naïve café"},
        {"role": "assistant", "content": "Bien sûr — 👍🏽 voilà."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nRéponds") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]  # as Engine.encode tokenizes a chat
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    for seed in range(3):
        deltas, result, _ = run(tok, ids, seed)
        assert "".join(deltas) == result.text == tok.decode(ids, skip_special_tokens=True)
    assert "voilà" in result.text and "👍🏽" in result.text


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_as_before(name, seed):
    tok = TOKENIZERS[name]()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    rng = random.Random(seed)
    start = rng.randrange(5, len(full) - 6)
    stops = [full[start : start + rng.randint(1, 5)], "never there", full[start + 2 : start + 9]]
    deltas, result, counting = run(tok, ids, seed, stops=stops)
    ref_deltas, ref_text, ref_ids = whole_text_reference(counting.decode, ids, steps(ids, seed, 5), stops)
    assert deltas == ref_deltas and result.text == ref_text and result.token_ids == ref_ids
    assert result.stats.finish_reason == "stop" and result.text == full[: full.index(stops[0])]
    assert "".join(deltas) == result.text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_linear_in_the_output_length(name):
    tok = TOKENIZERS[name]()
    ids = tok(TEXT * 40, add_special_tokens=False)["input_ids"]
    deltas, result, counting = run(tok, ids, seed=1, stops=["not in the text"])
    assert "".join(deltas) == result.text == tok.decode(ids, skip_special_tokens=True)
    # each step decodes a window of a few tokens twice, and the end decodes all ids once: ~6 ids per id here;
    # decoding the whole output at every step would be ~len(ids)**2 / 6 (hundreds of thousands)
    assert counting.ids < 10 * len(ids), (counting.ids, len(ids))


class _Chars:
    """An engine whose token ids are code points: decoding costs next to nothing, so a test times the stream."""

    @staticmethod
    def decode(ids):
        return "".join(map(chr, ids))


def _time_stream(ids, stops) -> tuple[float, TextStream]:
    import time

    stream = TextStream(_Chars(), ([i] for i in ids), Stats(), stops)
    t = time.perf_counter()
    deltas = list(stream)
    return time.perf_counter() - t, stream, deltas


def test_stop_string_check_is_linear_in_the_text():
    """Each step looks only at the text it adds (a streaming matcher), never at a tail as long as the stop
    strings: a stop string of the largest allowed length costs about what no stop string costs. The check
    that scanned the last len(stop) characters at each step took seconds here."""
    from specdecode.checks import STOP_CHARS_MAX

    ids = [ord("a")] * 8000
    plain, _, _ = _time_stream(ids, [])
    long, stream, deltas = _time_stream(ids, ["b" * STOP_CHARS_MAX])
    assert "".join(deltas) == stream.result.text == "a" * 8000
    assert long < 5 * plain + 0.5, (long, plain)


def test_stop_strings_are_bounded(tiny_engine):
    from specdecode.checks import STOP_CHARS_MAX

    with pytest.raises(SpecDecodeError, match=f"stop strings .* at most {STOP_CHARS_MAX}"):
        tiny_engine.stream("abc", stop=["x" * (STOP_CHARS_MAX // 2), "y" * (STOP_CHARS_MAX // 2 + 1)])
    with pytest.raises(SpecDecodeError, match="stop strings"):
        Engine.check(stop="z" * 200_000)
    Engine.check(stop=["x" * (STOP_CHARS_MAX // 2), "y" * (STOP_CHARS_MAX // 2)])  # at the cap: fine


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_with_partial_matches_as_before(seed):
    """Many overlapping partial matches (a two-letter alphabet): the streaming matcher finds the same stop,
    holds back the same text and emits the same deltas as the whole-text reference."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(rng.randint(5, 80)))
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
    ids = [ord(c) for c in text]
    stream = TextStream(_Chars(), steps(ids, seed, 4), Stats(), stops)
    deltas = list(stream)
    ref_deltas, ref_text, ref_ids = whole_text_reference(_Chars.decode, ids, steps(ids, seed, 4), stops)
    assert deltas == ref_deltas and stream.result.text == ref_text and stream.result.token_ids == ref_ids


class _CountingChars(_Chars):
    """_Chars, counting the ids it decodes."""

    def __init__(self):
        self.ids = 0

    def decode(self, ids):
        self.ids += len(ids)
        return "".join(map(chr, ids))


def test_a_genuine_replacement_character_is_sent_and_the_window_slides():
    """U+FFFD the model really wrote (its own token here) is text like any other: it goes out within a few
    tokens, not when some later token happens not to end in one, and a long run of them is decoded in
    linear time."""
    ids = [ord("a")] + [0xFFFD] * 3000 + [ord("b")]
    engine = _CountingChars()
    stream = TextStream(engine, ([i] for i in ids), Stats(), [])
    deltas = []
    for delta in stream:
        deltas.append(delta)
    assert "".join(deltas) == stream.result.text == "a" + "\ufffd" * 3000 + "b"
    assert len(deltas) > 2900  # each one out a few tokens after it came, not all of them with the "b"
    assert engine.ids < 20 * len(ids), engine.ids  # a few windows a token; the whole text each step: ~n**2 / 2


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_genuine_replacement_character_through_a_real_tokenizer(name):
    tok = TOKENIZERS[name]()
    text = "x\ufffd\ufffd y 日本 \ufffd🙂 z"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for seed in range(3):
        for most in (1, 5):
            deltas, result, _ = run(tok, ids, seed, most=most)
            assert "".join(deltas) == result.text == tok.decode(ids, skip_special_tokens=True)
            assert result.text.count("\ufffd") == 3 and "日本" in result.text and "🙂" in result.text
