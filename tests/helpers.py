"""Helpers shared by several test modules (test modules do not import from each other)."""

from __future__ import annotations

import importlib.metadata as md
import random
from functools import partial
from types import SimpleNamespace
from typing import Callable

import httpx
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdecode import SamplingParams, Stats, speculative_decode
from specdecode.backends import BUILTIN, DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.launch.http import tls
from specdecode.planning.costs import CostModel
from specdecode.sampling import sample
from specdecode.verify import verify as real_verify

GREEDY = SamplingParams()
# httpx's module-level requests on one TLS context: httpx makes one for each (~35 ms of CPU loading the CA file;
# the server tests send hundreds)
http = SimpleNamespace(**{name: partial(getattr(httpx, name), verify=tls()) for name in ("get", "post", "stream")})
TreeVerifier = Callable[..., tuple]


def default_pair_installed() -> bool:
    """Whether the packages that carry the default pair's GGUF chunks are installed (the `models` extra)."""
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        for req in BUILTIN[name].requirements():
            package, version = req.split("==")
            try:
                if md.version(package) != version:
                    return False
            except md.PackageNotFoundError:
                return False
    return True


# for tests that need the real default pair: marked `model`, and skipped (with the reason) where it is not installed;
# under pytest-xdist (--dist loadgroup) all of them run on one worker, one after another: they share the
# user's model cache (assembling, converting, requantizing, pass costs) and each uses every core
DEFAULT_PAIR_MARKS = [
    pytest.mark.model,
    pytest.mark.xdist_group("default_pair"),
    pytest.mark.skipif(
        not default_pair_installed(),
        reason='the default pair is not installed (pip install -e ".[models]"; CI installs it)',
    ),
]


def needs_default_pair(test):
    for mark in DEFAULT_PAIR_MARKS:
        test = mark(test)
    return test


# ============================================================= statistics (test_verify_stats and the others)

MIN_EXPECTED = 5.0


def gof_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of integer counts against a probability vector.

    Observations in a zero-probability cell are impossible under the hypothesis: p-value 0.
    Zero-probability cells are otherwise dropped, and cells with expected count < MIN_EXPECTED are
    merged (smallest first) into bins of expected count >= MIN_EXPECTED.
    """
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert observed.shape == probs.shape
    zero = probs <= 0
    if observed[zero].sum() > 0:
        return 0.0
    obs, prob = observed[~zero], probs[~zero]
    n = obs.sum()
    if n == 0 or obs.size < 2:
        return 1.0
    exp = prob / prob.sum() * n
    order = np.argsort(exp, kind="stable")
    exp, obs = exp[order], obs[order]
    bins_e, bins_o = [], []
    acc_e = acc_o = 0.0
    for e, o in zip(exp, obs):
        acc_e += e
        acc_o += o
        if acc_e >= MIN_EXPECTED:
            bins_e.append(acc_e)
            bins_o.append(acc_o)
            acc_e = acc_o = 0.0
    if acc_e > 0 or acc_o > 0:  # leftover small bin: merge into the last one
        if bins_e:
            bins_e[-1] += acc_e
            bins_o[-1] += acc_o
        else:
            bins_e.append(acc_e)
            bins_o.append(acc_o)
    if len(bins_e) < 2:
        return 1.0
    bins_e = np.array(bins_e)
    bins_e *= n / bins_e.sum()  # exact equality of totals for scipy
    return float(chisquare(np.array(bins_o), bins_e).pvalue)


def _draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling over the last dim (faster than torch.multinomial for many small rows).

    Zero-probability tokens are never drawn: u is in (0, 1] and the CDF is exactly 1 at the end.
    """
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[..., -1:]
    u = 1.0 - torch.rand(probs.shape[:-1], generator=g, dtype=torch.float64)
    return (cdf < u[..., None]).sum(-1).clamp(max=probs.shape[-1] - 1)


# ============================================================= wrong tree verifiers (negative controls)


def no_residual_update(final: str) -> TreeVerifier:
    """Negative control (i): siblings all tried against the original p (no residual update); when all
    are rejected, sample from norm(max(0, p - q_first_child)) ("residual") or from p ("p")."""

    def rule(p, tokens, parents, q=None, generator=None):
        children = [[] for _ in range(len(tokens) + 1)]
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)
        path, row = [], 0
        while True:
            dist = p[row]
            for child in children[row]:
                x = tokens[child]
                qx = 1.0 if q is None else float(q[child, x])
                if float(torch.rand((), generator=generator)) * qx < float(dist[x]):
                    path.append(child)
                    row = child + 1
                    break
            else:
                if children[row] and final == "residual":
                    first = children[row][0]
                    if q is None:
                        q_first = torch.zeros_like(dist).index_fill_(0, torch.tensor(tokens[first]), 1.0)
                    else:
                        q_first = q[first]
                    res = (dist - q_first).clamp(min=0)
                    dist = res / res.sum() if res.sum() > 0 else dist
                x = int(torch.multinomial(dist, 1, generator=generator))
                return path, x

    return rule


# ============================================================= the loop on token ids


def run(target, drafter, prompt, gamma, n, params=GREEDY, seed=0, eos=frozenset()):
    stats = Stats()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for new in speculative_decode(
        target,
        drafter,
        prompt,
        gamma=gamma,
        params=params,
        max_new_tokens=n,
        eos_ids=set(eos),
        generator=gen,
        stats=stats,
    ):
        out += new
    return out, stats


# ============================================================= tree shapes (test_lm_contract)


def random_tree(n, seed):
    """Local parents (-1 = the root) of a random tree with n nodes, parent before child."""
    rng = random.Random(seed)
    return [rng.randrange(-1, j) for j in range(n)]


def random_tokens(n, seed):
    rng = random.Random(1000 + seed)
    # a small alphabet on purpose: siblings and cousins often share a token, so only the mask tells them apart
    return [rng.choice([7, 11, 13, 200, 201]) for _ in range(n)]


# Local parents of the drafted nodes (index into the node list; -1 = the root).
# "branches": root has 3 children A(0) B(1) C(2); A has A1(3) A2(4); B -> B1(5) -> B11(7) -> B111(9)
# (depth 4 below the root); C has C1(6) C2(8). Nodes are interleaved, not laid out branch by branch.
BRANCHES = [-1, -1, -1, 0, 0, 1, 2, 5, 2, 7]

SHAPES = {
    "branches": BRANCHES,
    "chain": [-1, 0, 1, 2, 3, 4],
    "star": [-1] * 6,
    "chain_first": [-1, 0, 1, -1, 3, 0, 2, -1],  # the first branch is contiguous in the cache
    "random": random_tree(12, seed=3),
    "random_deep": random_tree(10, seed=11),
}


def path_of(local_parents, j):
    """Local node indices from the root's first child down to node j."""
    path = []
    while j >= 0:
        path.append(j)
        j = local_parents[j]
    return path[::-1]


# ============================================================= hand-made pass costs

# width is cheap (a target pass over 32 tokens costs 2 single ones), drafting is cheap
CHEAP = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4, 32: 2.0}, {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.1})

# width costs linearly, drafting is expensive: speculation hardly ever pays
EXPENSIVE = CostModel({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 32: 32.0}, {1: 0.5, 8: 4.0})


# ============================================================= wrong chain verifiers (negative controls)


def accept_everything(p, q, draft_tokens, generator=None):
    """WRONG on purpose: keeps every drafted token (the output then follows the drafter)."""
    gamma = p.shape[1] - 1
    return torch.full((p.shape[0],), gamma, dtype=torch.long), sample(p[:, gamma], generator)


def residual_is_p(p, q, draft_tokens, generator=None):
    """WRONG on purpose: after a rejection, samples from p instead of norm(max(0, p - q)): a rejected
    token comes back."""
    accepted, _ = real_verify(p, q, draft_tokens, generator)
    return accepted, sample(p[torch.arange(p.shape[0]), accepted], generator)


def run_child(cmd: list[str], *, timeout: float = 300, env: dict | None = None, **kwargs):
    """subprocess.run for the tests' child processes: one torch thread (like the test processes: OpenMP threads
    that spin for a core another worker holds make tiny models many times slower), and on a timeout a failure
    that shows what the child had printed and what was running on the machine, instead of a bare timeout."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    except subprocess.TimeoutExpired as e:
        ps = subprocess.run(
            ["ps", "-eo", "pid,ppid,stat,pcpu,rss,etime,args", "--sort=-pcpu"], capture_output=True, text=True
        ).stdout.splitlines()[:12]
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(
            f"{cmd[1:]} ran past {timeout} s\nstdout tail: {out[-500:]!r}\nstderr tail: {err[-1500:]!r}\n"
            "busiest processes:\n" + "\n".join(ps),
            pytrace=False,
        )


class LiveServer:
    """uvicorn on 127.0.0.1 and a free port, in a background thread (serve's Server: its shutdown order)."""

    def __init__(self, app, **config):
        import socket
        import threading
        import time

        import uvicorn

        from specdecode.server.app import Server

        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))  # serve's uvicorn
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    @property
    def worker(self):
        return self.app.state.worker

    def wait_idle(self, timeout=30.0):
        assert self.worker.wait_idle(timeout), "the worker is still busy"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
