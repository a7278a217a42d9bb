"""A causal LM together with the KV cache of the tokens it has seen.

The cache is Hugging Face's DynamicCache; this class adds the bookkeeping speculative decoding
needs: which token ids are cached, and `rollback`, the one cheap operation that forgets rejected
draft tokens (a slice of every layer's keys and values, no recomputation). `keep` is its general
form for token trees, where the accepted path is not a prefix of what was verified.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


class CachedLM:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.max_length = context_limit(model.config)
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        if not getattr(self.cache, "is_croppable", True):
            from .errors import SpecDecodeError
            raise SpecDecodeError(f"{type(self.model).__name__} keeps a cache that cannot be rolled back "
                                  "(linear/recurrent attention); speculative decoding needs one that can")
        # sliding-window layers drop old states once full; keep them until a crop, so rollback works
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.ids: list[int] = []  # token ids whose keys/values are in the cache, in order

    def __len__(self) -> int:
        return len(self.ids)

    @torch.inference_mode()
    def forward(self, new_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append new_ids to the cache; return float32 logits [len(new_ids), V] (or [1, V] if last_only)."""
        if not new_ids:
            raise ValueError("forward needs at least one token")
        x = torch.tensor([new_ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        self.ids.extend(new_ids)
        # sampling runs on the CPU with one seeded generator, whatever device the model is on
        return out.logits[0].float().cpu()

    def rollback(self, length: int) -> None:
        """Forget every cached token after the first `length`."""
        drop = len(self.ids) - length
        if drop < 0:
            raise ValueError(f"cannot roll back to {length}: only {len(self.ids)} tokens cached")
        # transformers 5.x: a negative value removes that many tokens; crop(0) also trims the
        # states a sliding-window layer recorded for us
        self.cache.crop(-drop)
        del self.ids[length:]

    def keep(self, positions: list[int]) -> None:
        """Keep only the cached entries at `positions` (ascending), e.g. one accepted tree path."""
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self.ids = [self.ids[i] for i in positions]


def context_limit(config) -> int:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30
