"""llama.cpp's own `llama-server` as a single-stream peer of `specdecode bench`: what its
speculation does on the same prompts, GGUF files and threads, next to ours.

Peers: `llama-server` (plain), `llama-server-draft` (`--spec-type draft-simple -md DRAFT`: the draft GGUF our engine
runs), `llama-server-ngram` (`--spec-type ngram-mod`), `llama-server-ngram-simple` (`--spec-type ngram-simple`, 16 deep;
`-64`: 64 deep). One server per peer for the whole run, launched by launch/servers.py (the same command lines as
`specdecode loadtest --launch`, one slot: `-np 1 -kvu`), stopped at the end. Each prompt goes to its native /completion
as our engine's prompt token ids: greedy (temperature 0, top-k 1, no repetition penalty), streamed, `cache_prompt:
false` (every run prefills, as ours do). TTFT is the first streamed token; the tokens are those the stream carries (the
end-of-generation token included, as in our runs), their count the server's `tokens_predicted`. llama-server does not
stream a token that ends mid-character on its own, so the token ids of such a run can lack one (its greedy agreement
then counts as a difference; the count stays right).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import SpecDecodeError

SERVER_PEERS = (
    "llama-server",
    "llama-server-draft",
    "llama-server-ngram",
    "llama-server-ngram-simple",
    "llama-server-ngram-simple-64",
)


def server_binary(path: str | None = None) -> str:
    """`path`, else the cached build of llama-server (then PATH); a clear error where there is none."""
    from ..launch.llama_server import find_binary

    found = path or find_binary("llama-server")
    if found is None:
        raise SpecDecodeError(
            "the llama-server peers need llama.cpp's llama-server, which is not built: "
            "specdecode loadtest --build-llama-server (about 11 min on 2 cores), "
            "or pass --llama-server PATH"
        )
    if not Path(found).is_file():
        raise SpecDecodeError(f"--llama-server: no such file: {found}")
    return str(found)


def check_server_peers(methods: list[str], binary: str | None, temperature: float) -> None:
    """What the llama-server peers in `methods` need, checked before any model loads: greedy, and the binary."""
    if not set(SERVER_PEERS) & set(methods):
        return
    if temperature != 0:
        raise SpecDecodeError("the llama-server peers are benchmarked greedy only (--temperature 0)")
    server_binary(binary)


class LlamaServerPeer:
    """One launched llama-server (one slot) for peer `name`; generate() like peers.LlamaPeer's; close() stops it."""

    def __init__(
        self, name: str, engine, binary: str, log_dir: Path, ctx: int | None = None, ready_timeout: float = 300.0
    ):
        from ..launch.servers import DEFAULT_CTX, Launched, free_port, peer_argv

        lm = engine.target
        if lm.gguf_path is None:
            raise SpecDecodeError(f"peer {name} needs the target on the llama.cpp backend (a GGUF model)")
        draft = None
        if name == "llama-server-draft":
            draft = engine.draft_model.lm.gguf_path if engine.draft_model else None
            if draft is None:
                raise SpecDecodeError("peer llama-server-draft needs a GGUF draft model on the llama.cpp backend")
        self.ctx = ctx or min(lm.max_length, DEFAULT_CTX)  # as peers.LlamaPeer's n_ctx
        port = free_port()
        self.argv = peer_argv(
            name,
            port=port,
            slots=1,
            threads=lm.threads,
            ctx=self.ctx,
            target=str(lm.gguf_path),
            draft=str(draft) if draft else None,
            llama_server=binary,
        )
        self.server = Launched(self.argv, port, Path(log_dir) / f"{name}.log", ready_timeout)
        self.server.__enter__()
        self.url = self.server.url

    def close(self) -> None:
        self.server.__exit__(None, None, None)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed) -> dict:
        from ..launch import http

        if temperature != 0:
            raise SpecDecodeError("the llama-server peers are benchmarked greedy only (--temperature 0)")
        body = {
            "prompt": list(prompt_ids),
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "repeat_penalty": 1.0,
            "stream": True,
            "cache_prompt": False,
            "return_tokens": True,
        }
        ids: list[int] = []
        ttft = final = None
        t = time.perf_counter()
        with http.stream("POST", self.url + "/completion", json=body, timeout=3600) as r:
            if r.status_code != 200:
                answer = r.read().decode(errors="replace")[:300]
                raise SpecDecodeError(f"llama-server answered {r.status_code}: {answer}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise SpecDecodeError(f"llama-server stream error: {json.dumps(chunk['error'])[:300]}")
                if chunk.get("tokens") and ttft is None:
                    ttft = time.perf_counter() - t
                ids += chunk.get("tokens") or []
                if chunk.get("stop"):
                    final = chunk
                    break
        wall = time.perf_counter() - t
        if final is None:
            raise SpecDecodeError("llama-server's stream ended without its final chunk")
        n = final.get("tokens_predicted", len(ids))
        return {"token_ids": ids, "new_tokens": n, "wall_s": wall, "ttft_s": ttft}


def make_server_peers(engine, methods: list[str], binary: str | None, log_dir: Path) -> dict:
    """A launched LlamaServerPeer per llama-server peer in `methods` (none launched if one fails to start)."""
    wanted = [m for m in methods if m in SERVER_PEERS]
    if not wanted:
        return {}
    binary = server_binary(binary)
    peers: dict = {}
    try:
        for m in wanted:
            peers[m] = LlamaServerPeer(m, engine, binary, log_dir)
    except BaseException:
        close_peers(peers)
        raise
    return peers


def close_peers(peers: dict) -> None:
    for peer in peers.values():
        close = getattr(peer, "close", None)
        if close is not None:
            close()
