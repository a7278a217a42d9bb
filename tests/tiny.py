"""Tiny random fp32 causal LMs with a byte-level tokenizer, built in the tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EOS = "<|endoftext|>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens + EOS: multi-byte characters span several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def char_tokenizer() -> PreTrainedTokenizerFast:
    """256 one-character tokens (printable ASCII, newline, then Greek letters) + EOS: every token decodes to text
    that encodes back to it, so a decoded output can be sent back as a prediction token for token."""
    chars = ([chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(0x391, 0x391 + 160)])[:256]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = byte_tokenizer().chat_template
    return fast


def tiny_model(
    seed: int,
    vocab_size: int = 257,
    layers: int = 2,
    hidden: int = 64,
    max_pos: int = 512,
    eos_token_id: int | None = 256,
) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen2ForCausalLM(config).float().eval()
    # Sharper than the default init, so that greedy paths have structure and sampling is not uniform.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_sliding_model() -> Qwen2ForCausalLM:
    """A tiny model whose layers all use a 16-token sliding window."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
        layer_types=["sliding_attention", "sliding_attention"],
    )
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def save_tiny(path: Path, seed: int, **kwargs) -> Path:
    model = tiny_model(seed, **kwargs)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def build_engine(
    target: int = 0, draft: int | None = 1, tokenizer=None, *, costs=None, progress: bool | None = None, **engine_kwargs
):
    """An Engine on tiny_model(target) with the draft tiny_model(draft) (draft=None: no draft model), both read with
    `tokenizer` (byte_tokenizer() by default); `costs` and `progress`, when given, are set on it; the other keyword
    arguments go to Engine (history_tokens, datastore, draft_window, exact, prompt_cache). conftest.py's
    `make_engine` fixture hands this out."""
    from specdecode import Engine

    tok = byte_tokenizer() if tokenizer is None else tokenizer
    engine = Engine(
        tiny_model(target),
        tok,
        None if draft is None else tiny_model(draft),
        None if draft is None else tok,
        **engine_kwargs,
    )
    if costs is not None:
        engine.costs = costs
    if progress is not None:
        engine.progress = progress
    return engine
