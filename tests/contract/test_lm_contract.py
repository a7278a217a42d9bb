"""The LM contract, run on both backends: token-tree passes and the KV rollback invariant.

Every test runs on the torch backend (`CachedLM` over `tiny.tiny_model(0)`, fp32) and on the llama.cpp backend
(`LlamaLM` over the same weights written as a tiny F32 GGUF, tinygguf.py), the latter on two contexts: llama.cpp's
default one (F16 keys/values, flash attention) and an exact one (F32 keys/values, flash attention off:
`tinygguf.exact_lm`). The reference for every check is a fresh prefill of the same text as a plain chain:

- a tree node's logits equal the last-position logits of (prompt + root + its ancestors + itself);
- after `rollback(length, path)` the cache behaves exactly like a fresh prefill of the committed text.

Tolerances (max |logit difference|, logits of size ~5; see test_llamacpp.py's docstring for llama.cpp's numerics):
torch compares with `torch.testing.assert_close(rtol=1e-4, atol=1e-4)` everywhere; llama.cpp compares a tree node
with its path run as a chain pass of the same size within PADDED_TOL, with a fresh prefill of its path within
CHAIN_TOL, and anything after a rollback within ROLLBACK_TOL (the order of the kept cells in the KV buffer changes
flash attention's sums on the default context).
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass

import pytest
import torch

from helpers import BRANCHES, SHAPES, path_of, random_tokens, random_tree
from specdecode.backends import CachedLM
from specdecode.errors import SpecDecodeError
from tiny import tiny_model

V = 257
PROMPT = [5, 17, 42, 99, 3, 8, 250]  # 7 tokens
ROOT = 61
THREADS = 1  # llama.cpp's workers spin-wait: one thread is far faster on a busy 2-core machine

TORCH_TOL = dict(rtol=1e-4, atol=1e-4)
PADDED_TOL = 2e-6  # llama.cpp: a tree node vs its path in a chain pass of the same size [default 0.0, exact 7.2e-7]
CHAIN_TOL = 1e-5  # llama.cpp: a tree node vs a fresh prefill of its path [9.5e-7]
ROLLBACK_TOL = {"llama.cpp": 6e-3, "llama.cpp-exact": 1e-5}  # after rollbacks [default 2.5e-3 .. 3.5e-3, exact 1.4e-6]

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None
NO_LLAMA = pytest.mark.skipif(not HAS_LLAMA, reason="the llama.cpp backend needs llama-cpp-python (not installed)")
BACKENDS = ["torch", pytest.param("llama.cpp", marks=NO_LLAMA), pytest.param("llama.cpp-exact", marks=NO_LLAMA)]


@dataclass
class Backend:
    """One backend under the contract: `lm` (empty), `ref` (another LM on the same weights, for reference passes),
    `fresh(ids)` and `close(got, want, kind, what)`, kind "padded", "chain" (before any rollback) or "kept" (after
    one)."""

    name: str
    lm: object
    ref: object
    tols: dict | None  # llama.cpp: max |difference| per kind; torch: None (assert_close with TORCH_TOL)

    def fresh(self, ids) -> torch.Tensor:
        """The last-position logits of a fresh prefill of ids (the reference LM reset: an empty cache)."""
        self.ref.reset()
        return self.ref.forward(list(ids), last_only=True)[-1]

    @property
    def is_llama(self) -> bool:
        return self.name.startswith("llama.cpp")

    def close(self, got, want, kind="chain", what=""):
        if self.tols is None:
            torch.testing.assert_close(got, want, **TORCH_TOL, msg=lambda m: f"{what}: {m}")
            return
        diff = (got - want).abs().max().item()
        assert diff <= self.tols[kind], f"{what}: max |logit difference| {diff:.3g} > {self.tols[kind]:.3g}"


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def llama_lms(tmp_path_factory):
    """{config: (lm under test, reference for fresh prefills)} on the tiny target GGUF, built once per module."""
    from specdecode.backends.llamacpp import LlamaLM
    from tinygguf import exact_lm, write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "target.gguf", 0)
    return {
        "llama.cpp": (LlamaLM(path, threads=THREADS), LlamaLM(path, threads=THREADS)),
        "llama.cpp-exact": (exact_lm(path, threads=THREADS), exact_lm(path, threads=THREADS)),
    }


@pytest.fixture(params=BACKENDS)
def backend(request, model) -> Backend:
    if request.param == "torch":
        return Backend("torch", CachedLM(model), CachedLM(model), None)
    lm, ref = request.getfixturevalue("llama_lms")[request.param]
    lm.reset()
    tols = {"padded": PADDED_TOL, "chain": CHAIN_TOL, "kept": ROLLBACK_TOL[request.param]}
    return Backend(request.param, lm, ref, tols)


def tree_pass(lm, root, tokens, local_parents):
    """One tree pass over root + nodes, root hanging off the last cached entry (or -1 if empty)."""
    start = len(lm)
    return lm.forward([root] + tokens, parents=[start - 1] + [start + 1 + p for p in local_parents])


def check_tree_logits(b: Backend, prefix, root, tokens, local_parents, logits, kind="chain"):
    """Each node's tree logits (and the root's) equal a fresh chain prefill of prefix + root + its path."""
    assert logits.shape == (1 + len(tokens), V)
    b.close(logits[0], b.fresh(prefix + [root]), kind, "root")
    for j in range(len(tokens)):
        text = prefix + [root] + [tokens[k] for k in path_of(local_parents, j)]
        b.close(logits[1 + j], b.fresh(text), kind, f"node {j}")


# Two ways to keep the root and an accepted branch below it:
#   "after_root":   rollback(len(prefix) + 1, branch)    -- the root is kept as part of `length`
#   "root_in_path": rollback(len(prefix), [root] + branch) -- the root is the branch's first entry
# Both describe the same committed text and must leave the same cache.
FORMS = ["root_in_path", "after_root"]


def keep_branch(lm, root, branch, form):
    """Keep cache entries [0, root] and the entries at branch (each the child of the one before)."""
    if form == "after_root":
        lm.rollback(root + 1, branch)
    else:
        lm.rollback(root, [root] + list(branch))


# ============================================================= 1. the tree mask


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_pass_equals_chain(backend, shape):
    """Every node of a tree pass gets the logits of its path run as a chain: in a chain pass of the same size
    (filler tokens after the path, which causal attention hides from it; bit for bit on llama.cpp's default
    context) and in a fresh prefill of the path alone."""
    b, lm = backend, backend.lm
    local = SHAPES[shape]
    tokens = random_tokens(len(local), seed=len(shape))
    lm.forward(PROMPT)
    logits = tree_pass(lm, ROOT, tokens, local)
    assert lm.ids == PROMPT + [ROOT] + tokens and logits.shape == (1 + len(tokens), V)
    check_tree_logits(b, PROMPT, ROOT, tokens, local, logits)
    n, ref = len(tokens) + 1, b.ref
    for j in range(-1, len(tokens)):
        chain = [ROOT] + [tokens[k] for k in (path_of(local, j) if j >= 0 else [])]
        ref.reset()
        ref.forward(PROMPT)
        padded = ref.forward(chain + [0] * (n - len(chain)))[len(chain) - 1]
        b.close(logits[j + 1], padded, "padded", f"node {j} vs padded chain")


@pytest.mark.parametrize("shape", ["branches", "chain", "random"])
def test_tree_pass_on_empty_cache_and_last_only(backend, shape):
    b, lm = backend, backend.lm
    local = SHAPES[shape]
    tokens = random_tokens(len(local), seed=5)
    logits = lm.forward([ROOT] + tokens, parents=[-1] + [1 + p for p in local])
    assert lm.ids == [ROOT] + tokens
    check_tree_logits(b, [], ROOT, tokens, local, logits)
    lm.reset()
    lm.forward(PROMPT)
    start = len(lm)
    last = lm.forward([ROOT] + tokens, last_only=True, parents=[start - 1] + [start + 1 + p for p in local])
    assert last.shape == (1, V)
    text = PROMPT + [ROOT] + [tokens[k] for k in path_of(local, len(local) - 1)]
    b.close(last[0], b.fresh(text), "chain", "last_only")


def test_tree_pass_last_only(backend):
    b, lm = backend, backend.lm
    tokens = random_tokens(len(BRANCHES), seed=2)
    lm.forward(PROMPT)
    start = len(lm)
    logits = lm.forward([ROOT] + tokens, last_only=True, parents=[start - 1] + [start + 1 + p for p in BRANCHES])
    assert logits.shape == (1, V)
    text = PROMPT + [ROOT] + [tokens[k] for k in path_of(BRANCHES, len(BRANCHES) - 1)]
    b.close(logits[0], b.fresh(text), "chain", "last_only")


def test_chain_parents_equal_plain_forward(backend):
    """Explicit consecutive parents are the same pass as parents=None."""
    b, lm_a, lm_b = backend, backend.lm, backend.ref
    lm_b.reset()
    lm_a.forward(PROMPT)
    lm_b.forward(PROMPT)
    new = [ROOT, 11, 12, 13]
    a = lm_a.forward(new, parents=list(range(len(PROMPT) - 1, len(PROMPT) - 1 + len(new))))
    bb = lm_b.forward(new)
    b.close(a, bb, "padded", "explicit chain parents vs parents=None")
    assert lm_a.ids == lm_b.ids


# ============================================================= 2. tree passes in a row


def test_tree_passes_in_a_row(backend):
    """Draft-model style: a pass of depth-1 nodes, then passes of their children, then grandchildren, hanging
    off nodes cached by earlier passes, without a rollback in between; then a branch made over three passes is
    kept."""
    b, lm = backend, backend.lm
    lm.forward(PROMPT)
    p = len(PROMPT)  # cache index of the root
    text = {p - 1: PROMPT}
    for tokens, parents in (
        ([ROOT, 20, 21, 20], [p - 1, p, p, p]),  # root + three children (the same token twice)
        ([30, 31, 30], [p + 1, p + 3, p + 1]),  # children of the first and third, interleaved
        ([40, 41, 42, 43], [p + 5, p + 2, p + 6, p + 7]),
    ):  # deeper, and a new node's child
        start = len(lm)
        logits = lm.forward(tokens, parents=parents)
        for k, (tok, par) in enumerate(zip(tokens, parents)):
            text[start + k] = text[par] + [tok]
            b.close(logits[k], b.fresh(text[start + k]), "chain", f"entry {start + k}")
    assert len(lm) == p + 11
    # keep a branch made over three passes: the root (p), 20 (p+3), 31 (p+5), 40 (p+7)
    lm.rollback(p, [p, p + 3, p + 5, p + 7])
    assert lm.ids == text[p + 7]
    b.close(lm.forward([77])[-1], b.fresh(text[p + 7] + [77]), "kept", "after the branch")


# ============================================================= 3. the rollback invariant
#
# After any rollback, the cache must behave like a fresh prefill of what it keeps: the next token's
# logits are compared with a fresh prefill.


def test_chain_rollbacks(backend):
    b, lm = backend, backend.lm
    prefix, draft = [5, 17, 42, 99, 3, 8], [11, 12, 13, 14, 15]
    lm.forward(prefix[:-1])
    lm.forward([prefix[-1]] + draft)
    for keep in (4, 2, 0):  # accept 4, then 2, then 0 draft tokens
        lm.rollback(len(prefix) + keep)
        assert lm.ids == prefix + draft[:keep]
        b.close(lm.forward([77])[-1], b.fresh(prefix + draft[:keep] + [77]), "kept", f"keep {keep}")
        lm.rollback(len(prefix) + keep)
    lm.rollback(2)  # deep inside the committed text
    b.close(lm.forward([78, 79])[-1], b.fresh(prefix[:2] + [78, 79]), "kept", "rollback(2)")
    lm.rollback(0)
    assert lm.ids == [] and lm.forward([9]).shape == (1, V)
    with pytest.raises(ValueError):
        lm.rollback(len(lm) + 1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "nodes",
    [
        [1, 5, 7, 9],  # B -> B1 -> B11 -> B111: non-contiguous, the deepest branch
        [1, 5],  # part of it
        [2, 8],  # C -> C2
        [0, 4],  # A -> A2: first node in place, the second moves
        [2],  # C alone (a single non-contiguous entry)
        [0, 3],  # A -> A1
        [],  # the root alone
    ],
)
def test_tree_branch_rollback(backend, nodes, form):
    b, lm = backend, backend.lm
    tokens = random_tokens(len(BRANCHES), seed=7)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    assert not nodes or path_of(BRANCHES, nodes[-1]) == nodes  # a real branch
    committed = PROMPT + [ROOT] + [tokens[j] for j in nodes]
    keep_branch(lm, root, [root + 1 + j for j in nodes], form)
    assert lm.ids == committed and len(lm) == len(committed)
    if not b.is_llama:  # torch's cache tensors are compacted to the committed text
        for layer in lm.cache.layers:
            assert layer.keys.shape[-2] == layer.values.shape[-2] == len(committed)
    got = lm.forward([77, 78, 79])
    for k in range(3):
        b.close(got[k], b.fresh(committed + [77, 78, 79][: k + 1]), "kept", f"token {k} after the branch")
    # and a tree pass hangs off the compacted cache like off a fresh one
    local = SHAPES["random"]
    more = random_tokens(len(local), seed=18)
    logits = tree_pass(lm, 80, more, local)
    text = committed + [77, 78, 79, 80]
    for j in range(len(more)):
        b.close(logits[j + 1], b.fresh(text + [more[k] for k in path_of(local, j)]), "kept", f"node {j}")


def test_rollback_rejects_all_tree_nodes(backend):
    b, lm = backend, backend.lm
    tokens = random_tokens(len(BRANCHES), seed=8)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    lm.rollback(root + 1)  # keep the root, reject every drafted node
    assert lm.ids == PROMPT + [ROOT]
    b.close(lm.forward([77])[-1], b.fresh(PROMPT + [ROOT, 77]), "kept", "root kept")
    # the same cache again, now a tree pass hanging off the kept root (still a tree entry)
    lm.rollback(root + 1)
    local = SHAPES["random"]
    more = random_tokens(len(local), seed=18)
    logits = tree_pass(lm, 77, more, local)
    check_tree_logits(b, PROMPT + [ROOT], 77, more, local, logits, "kept")
    # reject even the root
    lm.rollback(root, [])
    assert lm.ids == PROMPT
    b.close(lm.forward([78])[-1], b.fresh(PROMPT + [78]), "kept", "root rejected")


@pytest.mark.parametrize("form", FORMS)
def test_rollback_keeps_contiguous_first_branch(backend, form):
    b, lm = backend, backend.lm
    local = SHAPES["chain_first"]  # nodes 0 -> 1 -> 2 sit right after the root
    tokens = random_tokens(len(local), seed=9)
    root = len(PROMPT)
    for nodes in ([0, 1, 2], [0, 1], [0]):
        lm.reset()
        lm.forward(PROMPT)
        tree_pass(lm, ROOT, tokens, local)
        keep_branch(lm, root, [root + 1 + j for j in nodes], form)
        committed = PROMPT + [ROOT] + [tokens[j] for j in nodes]
        assert lm.ids == committed
        b.close(lm.forward([77])[-1], b.fresh(committed + [77]), "kept", f"kept {nodes}")


def test_rollback_inside_the_trunk_after_a_tree(backend):
    b, lm = backend, backend.lm
    tokens = random_tokens(len(BRANCHES), seed=3)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    lm.rollback(4)  # drops the whole tree and three committed tokens
    assert lm.ids == PROMPT[:4]
    b.close(lm.forward([77])[-1], b.fresh(PROMPT[:4] + [77]), "kept", "after rollback(4)")
    # a tree, a branch kept, then a rollback into the committed text that the branch had joined
    tree_pass(lm, ROOT, tokens, BRANCHES)
    lm.rollback(5, [5, 7, 11])  # the root (5) and B (7) -> B1 (11)
    assert lm.ids == PROMPT[:4] + [77, ROOT, tokens[1], tokens[5]]
    lm.rollback(6)  # keeps the root, drops B and B1
    b.close(lm.forward([78])[-1], b.fresh(PROMPT[:4] + [77, ROOT, 78]), "kept", "rollback into the branch")


def test_rollback_to_a_length_inside_the_tree(backend):
    """rollback(length) with an empty path and `length` inside the tree keeps those tree nodes as they
    are (siblings included); a later rollback then keeps a branch among them."""
    b, lm = backend, backend.lm
    tokens = random_tokens(len(BRANCHES), seed=11)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    lm.rollback(root + 4)  # root, A, B, C stay (siblings); A1, A2, B1, ... go
    assert lm.ids == PROMPT + [ROOT] + tokens[:3]
    # a chain token hangs off the last entry, C
    b.close(lm.forward([77])[-1], b.fresh(PROMPT + [ROOT, tokens[2], 77]), "kept", "child of C")
    # a tree pass hanging off A (cache root+1) and B (root+2)
    logits = lm.forward([30, 31], parents=[root + 1, root + 2])
    b.close(logits[0], b.fresh(PROMPT + [ROOT, tokens[0], 30]), "kept", "child of A")
    b.close(logits[1], b.fresh(PROMPT + [ROOT, tokens[1], 31]), "kept", "child of B")
    lm.rollback(root + 4)
    lm.rollback(root + 1)  # reject every node: the root stays, as a tree entry or in the trunk
    assert lm.ids == PROMPT + [ROOT]
    b.close(lm.forward([78])[-1], b.fresh(PROMPT + [ROOT, 78]), "kept", "root only")
    lm.rollback(root + 1)
    local = SHAPES["random"]
    more = random_tokens(len(local), seed=12)
    logits = tree_pass(lm, 79, more, local)
    for j in range(len(more)):
        b.close(logits[j + 1], b.fresh(PROMPT + [ROOT, 79] + [more[k] for k in path_of(local, j)]), "kept", f"n{j}")


def test_rollback_length_inside_the_tree_with_a_path(backend):
    """rollback(length, path) where `length` runs past the trunk into the tree: the tree part of the
    prefix is treated as the start of the branch."""
    b, lm = backend, backend.lm
    lm.forward(PROMPT)
    a, bb, c, a1 = 11, 12, 13, 14
    lm.forward([ROOT, a, bb, c, a1], parents=[6, 7, 7, 7, 8])  # a1 is a's child
    lm.rollback(9, [11])  # keep prompt + root + a, then a1
    assert lm.ids == PROMPT + [ROOT, a, a1]
    b.close(lm.forward([50])[-1], b.fresh(PROMPT + [ROOT, a, a1, 50]), "kept", "after the branch")


@pytest.mark.parametrize("form", FORMS)
def test_rounds_of_tree_pass_and_rollback(backend, form):
    """Engine style, 3 rounds: the cache holds committed[:-1]; the last committed token is the root
    of a tree pass (every node checked); a branch is accepted and a new token committed after it."""
    b, lm = backend, backend.lm
    rng = random.Random(0)
    committed = PROMPT + [ROOT]
    lm.forward(committed[:-1])
    for rnd in range(3):
        local = random_tree(8, seed=100 + rnd)
        tokens = random_tokens(8, seed=200 + rnd)
        root = len(committed) - 1
        assert len(lm) == root
        logits = tree_pass(lm, committed[-1], tokens, local)
        check_tree_logits(b, committed[:-1], committed[-1], tokens, local, logits, "kept")
        leaf = rng.choice([j for j in range(8) if j not in local])
        nodes = path_of(local, leaf)
        if rnd == 1:
            nodes = nodes[:1]  # accept only part of a branch
        keep_branch(lm, root, [root + 1 + j for j in nodes], form)
        committed += [tokens[j] for j in nodes]
        assert lm.ids == committed
        committed.append(90 + rnd)  # the bonus token: committed, not yet cached
    b.close(lm.forward([committed[-1]])[-1], b.fresh(committed), "kept", "after 3 rounds")
    assert lm.ids == committed


def test_many_rounds_of_tree_pass_and_rollback(backend):
    """Engine style, 300 rounds: tree pass from the last committed token, then one of the rollbacks
    (keep a branch, keep part of it, reject all, roll back into the tree then to the root). On llama.cpp every
    sequence id must come back (3,600 nodes go through a cache that holds 255 at a time)."""
    b, lm = backend, backend.lm
    rng = random.Random(0)
    committed = PROMPT + [ROOT]
    lm.forward(committed[:-1])
    for rnd in range(300):
        local = random_tree(12, seed=rnd)
        tokens = [rng.randrange(256) for _ in range(12)]
        root = len(committed) - 1
        assert len(lm) == root
        tree_pass(lm, committed[-1], tokens, local)
        kind = rnd % 4
        nodes = path_of(local, rng.choice([j for j in range(12) if j not in local]))
        if kind == 1:
            nodes = nodes[:1]
        elif kind == 2:
            nodes = []
        elif kind == 3:
            lm.rollback(root + 1 + rng.randrange(12))  # into the tree, empty path
            nodes = []
        keep_branch(lm, root, [root + 1 + j for j in nodes], FORMS[rnd % 2])
        committed += [tokens[j] for j in nodes]
        committed.append(rng.randrange(256))  # the bonus token: committed, not yet cached
        if len(committed) > 400:  # stay inside the 512-token context
            lm.rollback(len(PROMPT))
            committed = PROMPT + [committed[-1]]
        assert lm.ids == committed[:-1]
        if rnd % 50 == 49:
            b.close(lm.forward([committed[-1]])[-1], b.fresh(committed), "kept", f"round {rnd}")
            lm.rollback(len(committed) - 1)
    n = len(lm)
    logits = lm.forward([90] * 255, parents=[n - 1] * 255)
    b.close(logits[254], b.fresh(committed[:-1] + [90]), "kept", "255th sibling")
    b.close(logits[0], logits[254], "chain", "identical siblings")
    if b.is_llama:  # all 255 sequence ids are free again: 255 siblings fit in one pass, 256 do not
        lm.rollback(n)
        with pytest.raises(SpecDecodeError, match="255"):
            lm.forward([90] * 256, parents=[n - 1] * 256)
        assert len(lm) == n


def test_random_operations_match_fresh_prefills(backend):
    """Random sequences of tree passes (nodes off the trunk's end, off cached tree nodes from earlier
    passes, off nodes of the same pass), branch rollbacks, rollbacks to any length and refused rollbacks:
    every logits row equals a fresh prefill of the text of its entry."""
    b, lm = backend, backend.lm
    for seed in range(10):
        rng = random.Random(seed)
        lm.reset()
        texts: list[list[int]] = []  # per cache entry: the text it ends (its path from the start)
        parents: list[int] = []

        def feed(tokens, pars):
            logits = lm.forward(tokens, parents=pars)
            for tok, par in zip(tokens, pars):
                texts.append((texts[par] if par >= 0 else []) + [tok])
                parents.append(par)
            for k in range(len(tokens)):
                entry = len(texts) - len(tokens) + k
                b.close(logits[k], b.fresh(texts[entry]), "kept", f"seed {seed}, entry {entry}")
            assert lm.ids == [t[-1] for t in texts]

        n0 = rng.randrange(1, 20)
        feed([rng.randrange(256) for _ in range(n0)], list(range(-1, n0 - 1)))
        for _ in range(40):
            op = rng.random()
            if op < 0.45 or not texts:
                start, k = len(texts), rng.randrange(1, 12)
                hangs = [lm.trunk - 1] + list(range(lm.trunk, start))  # the trunk's end, or any tree entry
                pars = [rng.choice(hangs + list(range(start, start + b_))) for b_ in range(k)]
                feed([rng.choice([7, 11, 13, 200, 201]) for _ in range(k)], pars)
            elif op < 0.75:  # keep a branch: a chain from the start, cut anywhere
                chain, a = [], rng.randrange(len(texts))
                while a >= 0:
                    chain.append(a)
                    a = parents[a]
                chain.reverse()
                plain = 0
                while plain < len(chain) and chain[plain] == plain:
                    plain += 1
                length = rng.randrange(0, plain + 1)
                path = chain[length : rng.randrange(length, len(chain) + 1)]
                lm.rollback(length, path)
                keep = list(range(length)) + path
                index = {old: new for new, old in enumerate(keep)}
                texts = [texts[o] for o in keep]
                parents = [index[parents[o]] if parents[o] >= 0 else -1 for o in keep]
            elif op < 0.9:
                length = rng.randrange(0, len(texts) + 1)
                lm.rollback(length)
                texts, parents = texts[:length], parents[:length]
            else:  # a path that does not hang off entry length-1: refused, nothing changes
                length = rng.randrange(0, len(texts))
                bad = [j for j in range(length, len(texts)) if parents[j] != length - 1]
                if bad:
                    before = list(lm.ids)
                    with pytest.raises(ValueError):
                        lm.rollback(length, [rng.choice(bad)])
                    assert lm.ids == before
            assert lm.ids == [t[-1] for t in texts]
            if len(texts) > 300:
                break


# ============================================================= 4. errors


@pytest.mark.parametrize(
    "parents",
    [
        [6, 8, 7],  # token 1 (cache 8) is its own parent
        [6, 9, 7],  # token 1's parent comes after it
        [7, 7, 7],  # the root is its own parent
        [-2, 7, 7],  # below -1
        [6, 7],  # one parent too few
        [6, 7, 3],  # token 2 hangs inside the committed text
        [6, 7, -2],  # fails after token 1 got a sequence id (llama.cpp)
    ],
)
def test_bad_parents_raise_and_leave_the_cache_usable(backend, parents):
    b, lm = backend, backend.lm
    lm.forward(PROMPT)
    with pytest.raises(ValueError):
        lm.forward([ROOT, 11, 12], parents=parents)
    # nothing changed: the cache still works
    assert lm.ids == PROMPT
    b.close(lm.forward([77])[-1], b.fresh(PROMPT + [77]), "kept", "after the refused pass")
    if b.is_llama:  # llama.cpp checks ids against the vocabulary (torch's embedding raises IndexError)
        with pytest.raises(ValueError, match="vocabulary"):
            lm.forward([V])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "nodes",
    [
        [1, 6],  # B then C1: C1's parent is C, not B
        [5],  # B1 without B: does not hang off the root
        [5, 1],  # a branch, but not ascending
        [7, 5, 1],  # the same, deeper
        [0, 0],  # repeated
        [1, 5, 105],  # out of range
    ],
)
def test_invalid_branch_raises_and_changes_nothing(backend, nodes, form):
    b, lm = backend, backend.lm
    tokens = random_tokens(len(BRANCHES), seed=4)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    before = list(lm.ids)
    with pytest.raises(ValueError, match="not a branch"):
        keep_branch(lm, root, [root + 1 + j for j in nodes], form)
    assert lm.ids == before
    with pytest.raises(ValueError, match="not a branch"):
        lm.rollback(root, [root + 1])  # A hangs off the root, not off the last prompt token
    with pytest.raises(ValueError):
        lm.rollback(len(lm) + 1)
    # nothing was moved or cropped: a valid rollback still gives the right cache
    lm.rollback(root, [root, root + 2, root + 6])
    committed = PROMPT + [ROOT, tokens[1], tokens[5]]
    assert lm.ids == committed
    b.close(lm.forward([77])[-1], b.fresh(committed + [77]), "kept", "after the refused rollbacks")


def test_rollback_path_must_hang_off_length(backend):
    lm = backend.lm
    tokens = random_tokens(len(BRANCHES), seed=4)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    with pytest.raises(ValueError, match="not a branch"):
        lm.rollback(root, [root + 1])  # A's parent is the root, not the last prompt token
    with pytest.raises(ValueError, match="not a branch"):
        lm.rollback(root - 2, [root])  # the root hangs off entry root-1, not root-3
    with pytest.raises(ValueError):
        lm.rollback(len(lm) + 1)
    assert len(lm) == root + 1 + len(BRANCHES)
