"""Other tools' decoders, measured in the same bench run: llama-cpp-python's own generation (plain, and
with its prompt lookup), transformers' assisted generation with our draft model, and llama.cpp's own
llama-server (plain, with our draft model, with its n-gram speculation: server_peer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SpecDecodeError
from ..methods import METHOD_TABLE, method_names
from .server_peer import SERVER_PEERS

if TYPE_CHECKING:  # (torch and the engine load where a peer runs: `specdecode bench`'s parser needs the names only)
    from ..engine import Engine

# other tools' decoders, measured in the same run
PEERS = ("hf-assisted", "llama.cpp", "llama.cpp-pld", *SERVER_PEERS)
DRAFT_PEERS = ("hf-assisted", "llama-server-draft")  # the peers that run our draft model
BENCH_METHODS = (*method_names(), *PEERS)


def has_flag(m: str, need: str) -> bool:
    """Whether method m (a name in the method table; a peer never) has the table's flag `need`."""
    return m in METHOD_TABLE and bool(getattr(METHOD_TABLE[m], need))


class LlamaPeer:
    """llama-cpp-python's own high-level greedy generation on the same GGUF file and thread count
    (with its LlamaPromptLookupDecoding for llama.cpp-pld): what a user would run instead of us. It runs in
    a process of its own (llama_peer_child.py: in one process the model loaded first decodes slower), idle
    while ours runs; its times are taken there, around the generation only."""

    def __init__(self, engine: Engine, pld: bool, log_dir: str | Path = "bench-out/logs"):
        from ..host import user_env
        from ..launch.servers import DEFAULT_CTX

        lm = engine.target
        self.eos = sorted(engine.eos_ids)
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"llama-cpp-python{'-pld' if pld else ''}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("llama_peer_child.py"))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=user_env(),
            )  # as a user starts it (no huge pages asked for by us)
        cfg = dict(
            model_path=str(lm.gguf_path),
            n_ctx=min(lm.max_length, DEFAULT_CTX),
            threads=lm.threads,
            repack=bool(lm.repack),
            pld=pld,
        )  # repack: off where this build's AMX kernels crash, as ours
        try:
            self._ask(cfg)
        except BaseException:
            self.close()
            raise

    def _ask(self, obj: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise SpecDecodeError(
                f"the llama-cpp-python peer's process ended (exit {self.proc.poll()}); its log {self.log}:\n{tail}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise SpecDecodeError(f"the llama-cpp-python peer failed: {reply['error']}")
        return reply

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed) -> dict:
        if temperature != 0:
            raise SpecDecodeError("the llama.cpp peers are benchmarked greedy only (--temperature 0)")
        return self._ask({"prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens, "eos": self.eos})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of input ends the child
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def hf_assisted(
    engine: Engine, prompt_ids: list[int], gamma: int, max_new_tokens: int, temperature: float, seed: int | None
) -> dict:
    """The peer: transformers' assisted generation with the same models (its default schedule)."""
    import torch

    target, draft = engine.target.hf_model, engine.draft_model.lm.hf_model
    x = torch.tensor([prompt_ids], device=engine.target.device)
    # neutral settings, so that a checkpoint's own generation config (repetition penalty, top-p...) does
    # not make the peer decode a different distribution; its assistant schedule stays HF's default
    kwargs = dict(top_k=None, top_p=None, repetition_penalty=None)
    kwargs.update(dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature))
    if seed is not None:
        torch.manual_seed(seed)
    draft.generation_config.num_assistant_tokens = gamma
    t = time.perf_counter()
    out = target.generate(
        x,
        attention_mask=torch.ones_like(x),
        assistant_model=draft,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(engine.eos_ids) or None,
        pad_token_id=min(engine.eos_ids, default=None),
        **kwargs,
    )
    wall = time.perf_counter() - t
    ids = out[0, len(prompt_ids) :].tolist()
    # generate() returns everything at once: no time to first token (so no decode speed either)
    return {"token_ids": ids, "new_tokens": len(ids), "wall_s": wall, "ttft_s": None}
