"""A causal LM together with the KV cache of the tokens it has seen.

The cache is Hugging Face's DynamicCache; this class adds the bookkeeping speculative decoding
needs: which token ids are cached, where each sits in the text (its position) and what it may
attend to. The cache is a *trunk* (a plain prefix of committed text, causal attention) followed
by an optional *tree* of drafted tokens, each attending to the trunk and its own ancestors.

`rollback(length, path)` is the one cheap operation that forgets rejected draft tokens: keep the
first `length` entries, then the entries at `path` (the accepted branch of a tree; empty for a
chain, where it is a plain crop). It slices keys and values; nothing is recomputed.
"""

from __future__ import annotations

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import SpecDecodeError
from .base import LM, no_autograd


class CachedLM(LM):
    """A Hugging Face causal LM with its KV cache (the torch backend). The LM interface the engine,
    drafters, trees and cost model use, which llamacpp.LlamaLM implements too: forward, rollback,
    reset, len(), ids, max_length, vocab_size, eos_token_ids, describe(), synchronize()."""

    backend = "torch"
    exact = True  # nothing to switch at loading: exactness.py measures which passes are bit-exact
    can_pad = True  # forward pads a pass to pad_rows rows (exact mode, where that makes longer passes exact)

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_length = context_limit(model.config)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.eos_token_ids = model_eos_ids(model)
        self.cache_checked = False  # whether a pass has shown that the model keeps its keys and values in our cache
        self.reset()

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    @property
    def hf_model(self):
        return self.model

    def tolerances(self) -> dict:
        """bf16/fp16 round far more than fp32 (see LM.tolerances)."""
        if self.dtype in (torch.bfloat16, torch.float16):
            return {"rollback": 0.25, "tie": 0.25}
        return {"rollback": 1e-3, "tie": 1e-3}

    def output_truncation_error(self) -> str | None:
        return None

    def truncate_output(self, keep: torch.Tensor) -> None:
        """FR-Spec: replace the output layer by one with only the rows `keep` (the input embeddings stay
        whole: the model still reads every token)."""
        head = self.model.get_output_embeddings()
        w = head.weight
        new = torch.nn.Linear(
            w.shape[1], len(keep), bias=getattr(head, "bias", None) is not None, device=w.device, dtype=w.dtype
        )
        with torch.no_grad():
            new.weight.copy_(w[keep.to(w.device)])
            if new.bias is not None:
                new.bias.copy_(head.bias[keep.to(w.device)])
        self.model.set_output_embeddings(new)

    def describe(self) -> str:
        """What pass costs depend on: the model, dtype, device, torch build and threads."""
        m = self.model
        return "|".join(
            [
                torch.__version__,
                str(torch.get_num_threads()),
                str(getattr(m.config, "_name_or_path", "")),
                type(m).__name__,
                str(m.num_parameters()),
                str(self.dtype),
                str(self.device),
                torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "",
            ]
        )

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reset(self) -> None:
        cache = getattr(self, "cache", None)
        if cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers):
            cache.reset()  # full-attention layers only: emptied in place (a new DynamicCache reads the whole config)
        else:
            self.cache = DynamicCache(config=self.model.config)
        if not getattr(self.cache, "is_croppable", True):
            raise SpecDecodeError(
                f"{type(self.model).__name__} keeps a cache that cannot be rolled back "
                "(linear/recurrent attention); speculative decoding needs one that can"
            )
        # sliding-window layers drop old states once full; keep them until a crop, so rollback works
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.ids: list[int] = []  # token ids whose keys/values are in the cache, in cache order
        self.trunk = 0  # entries [0, trunk) are a plain prefix: entry i sits at position i
        self.parent: list[int] = []  # for tree entries (index >= trunk): cache index of the parent
        self.pos: list[int] = []  # for tree entries: position in the text (depth below the trunk)

    def __len__(self) -> int:
        return len(self.ids)

    def forward(self, new_ids: list[int], last_only: bool = False, parents: list[int] | None = None) -> torch.Tensor:
        """Append new_ids to the cache; return float32 logits [len(new_ids), V] (or [1, V] if last_only).

        parents=None: new_ids continue the text causally. Otherwise parents[j] is the cache index
        (counted after the append) of the token new_ids[j] follows; it must come before j. That is a
        token tree: each token attends to the trunk and its own ancestors only, at its own depth.
        A pass of fewer than pad_rows tokens runs as pad_rows rows: the padding continues the last token as a
        chain (no real token attends to it) and its cells are rolled back before returning.
        """
        extra = self.pad_rows - len(new_ids)
        if not new_ids or extra <= 0:
            return self._pass(new_ids, last_only, parents)
        start, n = len(self.ids), len(new_ids)
        padded = None if parents is None else list(parents) + [start + n - 1 + a for a in range(extra)]
        out = self._pass(list(new_ids) + [new_ids[-1]] * extra, False, padded)
        self.rollback(start + n)
        return out[n - 1 : n] if last_only else out[:n]

    @no_autograd
    def _pass(self, new_ids: list[int], last_only: bool, parents: list[int] | None) -> torch.Tensor:
        if not new_ids:
            raise ValueError("forward needs at least one token")
        start = len(self.ids)
        x = torch.tensor([new_ids], dtype=torch.long, device=self.device)  # [1, n]
        chain = list(range(start - 1, start - 1 + len(new_ids)))
        parents = chain if parents is None else list(parents)
        if len(parents) != len(new_ids):
            raise ValueError(f"{len(new_ids)} tokens but {len(parents)} parents")
        causal = self.trunk == start and parents == chain  # plain causal attention, no mask to build
        kwargs = {} if causal else self._tree_inputs(start, parents)
        before = None if self.cache_checked else self.cache.get_seq_length()
        out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0, **kwargs)
        if before is not None:  # the model's first pass: does it keep its keys and values in our cache?
            # transformers before 5.24 takes the cache as `past_key_values`: its models swallow `cache=`
            # into **kwargs and build a throwaway cache, and every later pass would be silently wrong
            grown = self.cache.get_seq_length() - before
            if grown == len(new_ids):
                self.cache_checked = True
            else:
                raise SpecDecodeError(
                    f"{type(self.model).__name__} did not use the KV cache it was given (the cache "
                    f"grew by {grown} entries for {len(new_ids)} tokens). specdecode needs "
                    f"transformers>=5.24,<6, whose models take `cache=` (installed: "
                    f"{transformers.__version__}), and a model that keeps its keys and values there"
                )
        self.ids.extend(new_ids)
        if causal:
            self.trunk = len(self.ids)
        else:
            self.parent.extend(parents)
            self.pos.extend(kwargs["position_ids"][0].tolist())
            # leading tokens that continue the trunk and that every later token descends from
            # (a tree's root) join the trunk
            j = 0
            while (
                self.trunk == start + j < len(self.ids)
                and parents[j] == start + j - 1
                and all(par >= start + j for par in parents[j + 1 :])
            ):
                j += 1
                self.trunk += 1
                self.parent.pop(0)
                self.pos.pop(0)
        # sampling runs on the CPU with one seeded generator, whatever device the model is on
        return out.logits[0].float().cpu()

    def _position(self, i: int) -> int:
        return i if i < self.trunk else self.pos[i - self.trunk]

    def tree_error(self) -> str | None:
        """Why this model cannot run token trees (a pass with a custom mask and positions); None if it can.
        Worked out again only when the config's attention implementation changes (asked every tree pass)."""
        key = (id(self.model.config), getattr(self.model.config, "_attn_implementation", None))
        if getattr(self, "_tree_error_for", None) != key:
            self._tree_error_for, self._tree_error = key, self._find_tree_error()
        return self._tree_error

    def _find_tree_error(self) -> str | None:
        name = type(self.model).__name__
        if _has_sliding_layers(self.model.config):
            return (
                f"{name} has sliding-window attention layers; token trees need full attention "
                "(use a chain method: draft or pld)"
            )
        impl = attn_implementation(self.model.config)
        if impl not in TREE_ATTENTION:
            # flash-attention, flex, paged and hub kernels build their own causal mask and ignore (or
            # reject) a custom 4-D one: a tree pass would attend across branches, silently
            return (
                f"token trees need an attention implementation that applies a custom 4-D mask (sdpa or "
                f'eager); {name} runs {impl!r}. Load the model with attn_implementation="sdpa" (or '
                '"eager"), or use a chain method (draft or pld)'
            )
        return None

    def _tree_inputs(self, start: int, parents: list[int]) -> dict:
        error = self.tree_error()
        if error:
            raise SpecDecodeError(error)
        n, trunk = len(parents), self.trunk
        total, width = start + n, start + n - trunk
        # the columns past the trunk (which every token attends to): 1 where token j may not attend, written
        # in a bytearray and read as one tensor (a tensor op per entry, or a list of floats, costs far more)
        hidden, positions = bytearray(b"\x01") * (n * width), []
        for j, par in enumerate(parents):
            i = start + j
            if not -1 <= par < i:
                raise ValueError(f"token {j} of a tree pass has parent {par}; a parent must come before it")
            if par < trunk - 1:  # every token attends to the whole trunk: a node hanging inside it would too
                raise ValueError(
                    f"token {j} of a tree pass hangs off entry {par}, inside the committed text; "
                    f"a tree hangs off its last entry ({trunk - 1})"
                )
            positions.append(0 if par < 0 else (positions[par - start] if par >= start else self._position(par)) + 1)
            row = j * width - trunk  # hidden[row + c]: column c of token j
            hidden[row + i] = 0
            a = par
            while a >= trunk:
                hidden[row + a] = 0
                a = parents[a - start] if a >= start else self.parent[a - trunk]
        mask = torch.zeros(n, total, dtype=self.dtype)
        hidden_mask = torch.frombuffer(hidden, dtype=torch.bool).view(n, width)
        mask[:, trunk:].masked_fill_(hidden_mask, torch.finfo(self.dtype).min)
        return {
            "attention_mask": mask[None, None].to(self.device),  # [1, 1, n, total]: additive
            "position_ids": torch.tensor([positions], dtype=torch.long, device=self.device),
        }

    @no_autograd
    def rollback(self, length: int, path: list[int] = ()) -> None:
        """Keep the first `length` cached entries, then the entries at `path` (ascending cache
        indices, each the child of the one before: an accepted tree branch). All else is forgotten."""
        length, path = self._branch(length, path)
        if path and path != list(range(length, length + len(path))):
            index = torch.tensor(path, dtype=torch.long, device=self.device)
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    # move the branch right behind the prefix, then crop the rest below
                    layer.keys[..., length : length + len(path), :] = layer.keys.index_select(-2, index)
                    layer.values[..., length : length + len(path), :] = layer.values.index_select(-2, index)
        keep = length + len(path)
        # transformers 5.x: a negative value removes that many tokens; crop(0) also trims the
        # states a sliding-window layer recorded for us
        self.cache.crop(-(len(self.ids) - keep))
        self.ids = self.ids[:length] + [self.ids[i] for i in path]
        self.trunk = min(self.trunk, length) if not path else keep
        if self.trunk < length:  # rolled back inside a tree branch: keep its ancestry
            self.parent, self.pos = self.parent[: length - self.trunk], self.pos[: length - self.trunk]
        else:
            self.trunk, self.parent, self.pos = keep, [], []

    def _parent(self, i: int) -> int:
        return i - 1 if i < self.trunk else self.parent[i - self.trunk]


def model_eos_ids(model) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


TREE_ATTENTION = ("eager", "sdpa")  # the implementations that apply an additive 4-D mask as given


def attn_implementation(config) -> str | None:
    """The attention implementation the (text) decoder runs: "sdpa", "eager", "flash_attention_2", ..."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(cfg, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


def _has_sliding_layers(config) -> bool:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None) or []
    return any("sliding" in t or "chunked" in t for t in types) or bool(
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    )


def context_limit(config) -> int:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30
