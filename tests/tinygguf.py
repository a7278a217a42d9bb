"""Tiny random F32 GGUF models (llama.cpp arch "qwen2", or "llama") for tests that load through llama.cpp or GGUF.

`write_tiny_gguf` writes the same weights as `tiny.tiny_model(seed, ...)` under llama.cpp's tensor names,
with `tiny.byte_tokenizer()`'s vocabulary in the metadata: the 256 GPT-2 byte symbols, `<|endoftext|>`
(id 256, EOS and BOS, no BOS added), and `vocab_extra` more plain tokens that no text encodes to (a
vocabulary that differs from another model's). Both llama.cpp and transformers (`gguf_file=`) load it and
give the HF model's logits. With arch="llama", the same shapes as a transformers Llama (no attention biases).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tiny import EOS, byte_tokenizer, tiny_model

T = gguf.MODEL_TENSOR
# HF Qwen2 parameter (per layer) -> llama.cpp tensor. Q and K are stored as they are: llama.cpp's qwen2
# graph applies NEOX-style RoPE (rotate halves, as HF does), so nothing is permuted (unlike arch "llama").
LAYER = {
    "input_layernorm": T.ATTN_NORM,
    "self_attn.q_proj": T.ATTN_Q,
    "self_attn.k_proj": T.ATTN_K,
    "self_attn.v_proj": T.ATTN_V,
    "self_attn.o_proj": T.ATTN_OUT,
    "post_attention_layernorm": T.FFN_NORM,
    "mlp.gate_proj": T.FFN_GATE,
    "mlp.up_proj": T.FFN_UP,
    "mlp.down_proj": T.FFN_DOWN,
}
TOP = {"model.embed_tokens": T.TOKEN_EMBD, "model.norm": T.OUTPUT_NORM, "lm_head": T.OUTPUT}


class _Writer(gguf.GGUFWriter):
    """GGUFWriter refuses to write an empty array, but a BPE vocabulary needs `tokenizer.ggml.merges`:
    llama.cpp fails without the key, and no dummy merge will do, since transformers' BPE requires both
    halves and their join to be tokens and a byte vocabulary has no such pair. llama.cpp and transformers
    both read an empty array fine, and with no merges every byte stays one token, as in `byte_tokenizer()`."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _tensor_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")  # kind: "weight" or "bias"
    if module in TOP:
        return f"{gguf.TENSOR_NAMES[TOP[module]]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    return f"{gguf.TENSOR_NAMES[LAYER[rest]].format(bid=int(layer))}.{kind}"


def tiny_llama(seed: int, vocab_size: int = 257, layers: int = 2, hidden: int = 64, max_pos: int = 512):
    """A transformers Llama with tiny_model's shapes and sharpened output layer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        eos_token_id=256,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def _llama_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows reordered from HF's rotate-halves RoPE to llama.cpp's interleaved pairs (arch "llama"), as
    llama.cpp's convert_hf_to_gguf.py does."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    seed: int,
    *,
    vocab_extra: int = 0,
    layers: int = 2,
    hidden: int = 64,
    ctx: int = 512,
    special: tuple[str, ...] = (),
    arch: str = "qwen2",
) -> Path:
    """special: control tokens appended after the extra ones (llama.cpp recognizes some by their text, such as
    <|im_end|> or <|eom_id|>, as ending a generation). arch: "qwen2" (tiny.tiny_model) or "llama" (tiny_llama)."""
    tokens = list(byte_tokenizer().convert_ids_to_tokens(range(257)))  # byte symbols in tiny.py's order, EOS
    assert tokens[256] == EOS
    tokens += [f"<extra_{i}>" for i in range(vocab_extra)] + list(special)
    build = {"qwen2": tiny_model, "llama": tiny_llama}[arch]
    model = build(seed, vocab_size=len(tokens), layers=layers, hidden=hidden, max_pos=ctx)
    cfg = model.config

    w = _Writer(str(path), arch)
    w.add_name(f"tiny-{arch}-{seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(tokens))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == EOS or t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    w.add_eos_token_id(256)
    w.add_bos_token_id(256)
    w.add_add_bos_token(False)
    w.add_chat_template(byte_tokenizer().chat_template)

    for name, tensor in model.state_dict().items():
        data = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _llama_rope_rows(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        w.add_tensor(_tensor_name(name), data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def exact_lm(path: Path, threads: int = 1):
    """A LlamaLM on a context with F32 keys/values and flash attention off (only llama.cpp's context parameters
    differ from the default context). Where a cell sits in the KV buffer still sets the order attention sums in:
    float32 rounding."""
    import llama_cpp
    import pytest

    from specdecode.backends.llamacpp import LlamaLM

    default_params = llama_cpp.llama_context_default_params

    def params():
        p = default_params()
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = llama_cpp.GGML_TYPE_F32
        return p

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_cpp, "llama_context_default_params", params)
        return LlamaLM(path, threads=threads)
