"""Token trees in CachedLM: the tree attention mask, per-token positions, and branch compaction.

Reference for every check: a fresh CachedLM that prefills the same text as a plain chain. A tree
node's logits must equal the last-position logits of (prompt + root + its ancestors + itself); after
`rollback(length, path)` the cache must behave exactly like a fresh prefill of the committed text.
"""
import random  # noqa: F401

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.backends import CachedLM
from helpers import BRANCHES, SHAPES, path_of, random_tokens, random_tree  # noqa: F401
from tiny import tiny_model, tiny_sliding_model

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPT = [5, 17, 42, 99, 3, 8, 250]  # 7 tokens
ROOT = 61


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def chain_logits(model, ids):
    """Last-position logits of a fresh plain-chain prefill of ids."""
    return CachedLM(model).forward(list(ids), last_only=True)[-1]


def tree_pass(lm, root, tokens, local_parents):
    """One tree pass over root + nodes, root hanging off the last cached entry (or -1 if empty)."""
    start = len(lm)
    parents = [start - 1] + [start + 1 + p for p in local_parents]
    return lm.forward([root] + tokens, parents=parents)


def check_tree_logits(model, prefix, root, tokens, local_parents, logits):
    """Each node's tree logits equal a fresh chain prefill of prefix + root + its path."""
    assert logits.shape == (1 + len(tokens), 257)
    torch.testing.assert_close(logits[0], chain_logits(model, prefix + [root]), **TOL)
    for j in range(len(tokens)):
        text = prefix + [root] + [tokens[k] for k in path_of(local_parents, j)]
        torch.testing.assert_close(logits[1 + j], chain_logits(model, text), **TOL, msg=lambda m: f"node {j}: {m}")


# ---------------------------------------------------------------- 1. the tree mask


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_pass_equals_chain_prefill(model, shape):
    local_parents = SHAPES[shape]
    tokens = random_tokens(len(local_parents), seed=len(shape))
    lm = CachedLM(model)
    lm.forward(PROMPT)
    logits = tree_pass(lm, ROOT, tokens, local_parents)
    assert lm.ids == PROMPT + [ROOT] + tokens
    check_tree_logits(model, PROMPT, ROOT, tokens, local_parents, logits)


@pytest.mark.parametrize("shape", ["branches", "chain", "random"])
def test_tree_pass_on_empty_cache(model, shape):
    local_parents = SHAPES[shape]
    tokens = random_tokens(len(local_parents), seed=5)
    lm = CachedLM(model)
    logits = lm.forward([ROOT] + tokens, parents=[-1] + [1 + p for p in local_parents])
    assert lm.ids == [ROOT] + tokens
    check_tree_logits(model, [], ROOT, tokens, local_parents, logits)


def test_tree_pass_last_only(model):
    tokens = random_tokens(len(BRANCHES), seed=2)
    lm = CachedLM(model)
    lm.forward(PROMPT)
    start = len(lm)
    logits = lm.forward([ROOT] + tokens, last_only=True, parents=[start - 1] + [start + 1 + p for p in BRANCHES])
    assert logits.shape == (1, 257)
    text = PROMPT + [ROOT] + [tokens[k] for k in path_of(BRANCHES, len(BRANCHES) - 1)]
    torch.testing.assert_close(logits[0], chain_logits(model, text), **TOL)


def test_chain_parents_equal_plain_forward(model):
    """Explicit consecutive parents are the same pass as parents=None."""
    lm_a, lm_b = CachedLM(model), CachedLM(model)
    lm_a.forward(PROMPT)
    lm_b.forward(PROMPT)
    new = [ROOT, 11, 12, 13]
    a = lm_a.forward(new, parents=list(range(len(PROMPT) - 1, len(PROMPT) - 1 + len(new))))
    b = lm_b.forward(new)
    torch.testing.assert_close(a, b, **TOL)
    assert lm_a.ids == lm_b.ids


# ---------------------------------------------------------------- 2. tree passes in a row


def test_two_tree_passes_without_rollback(model):
    """Draft-model style: a pass of depth-1 nodes, then passes of their children, then grandchildren."""
    lm = CachedLM(model)
    lm.forward(PROMPT)
    p = len(PROMPT)  # cache index of the root
    # pass 1: root + three children a, b, c (cache 8, 9, 10); the same token twice on purpose
    first = lm.forward([ROOT, 20, 21, 20], parents=[p - 1, p, p, p])
    text = {p: PROMPT + [ROOT]}
    for i, tok in zip(range(p + 1, p + 4), [20, 21, 20]):
        text[i] = text[p] + [tok]
    for k, i in enumerate(range(p, p + 4)):
        torch.testing.assert_close(first[k], chain_logits(model, text[i]), **TOL)
    # pass 2: children of a (8) and c (10), interleaved: cache 11, 12, 13
    second = lm.forward([30, 31, 30], parents=[p + 1, p + 3, p + 1])
    for i, (tok, par) in zip(range(p + 4, p + 7), [(30, p + 1), (31, p + 3), (30, p + 1)]):
        text[i] = text[par] + [tok]
    for k, i in enumerate(range(p + 4, p + 7)):
        torch.testing.assert_close(second[k], chain_logits(model, text[i]), **TOL, msg=lambda m: f"entry {i}: {m}")
    # pass 3: children of pass-2 entries (12, 13) and of a pass-1 entry (9); a child of a new node too
    third = lm.forward([40, 41, 42, 43], parents=[p + 5, p + 2, p + 6, p + 7])
    for i, (tok, par) in zip(range(p + 7, p + 11), [(40, p + 5), (41, p + 2), (42, p + 6), (43, p + 7)]):
        text[i] = text[par] + [tok]
    for k, i in enumerate(range(p + 7, p + 11)):
        torch.testing.assert_close(third[k], chain_logits(model, text[i]), **TOL, msg=lambda m: f"entry {i}: {m}")
    assert len(lm) == p + 11


# ---------------------------------------------------------------- 3. compaction: rollback(length, path)
#
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


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("nodes", [
    [1, 5, 7, 9],  # B -> B1 -> B11 -> B111: non-contiguous, the deepest branch
    [1, 5],  # part of it
    [2, 8],  # C -> C2
    [0, 4],  # A -> A2: first node in place, the second moves
    [2],  # C alone (a single non-contiguous entry)
    [0, 3],  # A -> A1
])
def test_rollback_keeps_branch(model, nodes, form):
    tokens = random_tokens(len(BRANCHES), seed=7)
    lm = CachedLM(model)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    assert path_of(BRANCHES, nodes[-1]) == nodes  # a real branch
    committed = PROMPT + [ROOT] + [tokens[j] for j in nodes]
    keep_branch(lm, root, [root + 1 + j for j in nodes], form)
    assert lm.ids == committed and len(lm) == len(committed)
    for layer in lm.cache.layers:
        assert layer.keys.shape[-2] == layer.values.shape[-2] == len(committed)
    got = lm.forward([77, 78, 79])
    fresh = CachedLM(model).forward(committed + [77, 78, 79])
    torch.testing.assert_close(got, fresh[-3:], **TOL)


def test_rollback_rejects_all_tree_nodes(model):
    tokens = random_tokens(len(BRANCHES), seed=8)
    lm = CachedLM(model)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    lm.rollback(root + 1)  # keep the root, reject every drafted node
    assert lm.ids == PROMPT + [ROOT]
    torch.testing.assert_close(lm.forward([77])[-1], chain_logits(model, PROMPT + [ROOT, 77]), **TOL)
    # the same cache again, now a tree pass hanging off the kept root (still a tree entry)
    lm.rollback(root + 1)
    local = SHAPES["random"]
    more = random_tokens(len(local), seed=18)
    logits = tree_pass(lm, 77, more, local)
    check_tree_logits(model, PROMPT + [ROOT], 77, more, local, logits)
    # reject even the root
    lm.rollback(root, [])
    assert lm.ids == PROMPT
    torch.testing.assert_close(lm.forward([78])[-1], chain_logits(model, PROMPT + [78]), **TOL)


@pytest.mark.parametrize("form", FORMS)
def test_rollback_keeps_contiguous_first_branch(model, form):
    local = SHAPES["chain_first"]  # nodes 0 -> 1 -> 2 sit right after the root
    tokens = random_tokens(len(local), seed=9)
    root = len(PROMPT)
    for nodes in ([0, 1, 2], [0, 1], [0]):
        lm = CachedLM(model)
        lm.forward(PROMPT)
        tree_pass(lm, ROOT, tokens, local)
        keep_branch(lm, root, [root + 1 + j for j in nodes], form)
        committed = PROMPT + [ROOT] + [tokens[j] for j in nodes]
        assert lm.ids == committed
        torch.testing.assert_close(lm.forward([77])[-1], chain_logits(model, committed + [77]), **TOL)


@pytest.mark.parametrize("form", FORMS)
def test_rounds_of_tree_pass_and_rollback(model, form):
    """Engine style, 3 rounds: the cache holds committed[:-1]; the last committed token is the root
    of a tree pass; a branch is accepted and a new token committed after it."""
    rng = random.Random(0)
    lm = CachedLM(model)
    committed = PROMPT + [ROOT]
    lm.forward(committed[:-1])
    for rnd in range(3):
        local = random_tree(8, seed=100 + rnd)
        tokens = random_tokens(8, seed=200 + rnd)
        root = len(committed) - 1
        assert len(lm) == root
        logits = tree_pass(lm, committed[-1], tokens, local)
        check_tree_logits(model, committed[:-1], committed[-1], tokens, local, logits)
        leaf = rng.choice([j for j in range(8) if j not in local])
        nodes = path_of(local, leaf)
        if rnd == 1:
            nodes = nodes[:1]  # accept only part of a branch
        keep_branch(lm, root, [root + 1 + j for j in nodes], form)
        committed += [tokens[j] for j in nodes]
        assert lm.ids == committed
        committed.append(90 + rnd)  # the bonus token: committed, not yet cached
    got = lm.forward([committed[-1]])[-1]
    torch.testing.assert_close(got, chain_logits(model, committed), **TOL)
    assert lm.ids == committed


# ---------------------------------------------------------------- 4. errors


@pytest.mark.parametrize("parents", [
    [6, 8, 7],  # token 1 (cache 8) is its own parent
    [6, 9, 7],  # token 1's parent comes after it
    [7, 7, 7],  # the root is its own parent
    [-2, 7, 7],  # below -1
    [6, 7],  # one parent too few
])
def test_bad_parent_raises(model, parents):
    lm = CachedLM(model)
    lm.forward(PROMPT)
    with pytest.raises(ValueError):
        lm.forward([ROOT, 11, 12], parents=parents)
    # nothing changed: the cache still works
    assert lm.ids == PROMPT
    torch.testing.assert_close(lm.forward([77])[-1], chain_logits(model, PROMPT + [77]), **TOL)


@pytest.mark.parametrize("nodes", [
    [1, 6],  # B then C1: C1's parent is C, not B
    [5],  # B1 without B: does not hang off the root
    [5, 1],  # a branch, but not ascending
    [7, 5, 1],  # the same, deeper
    [0, 0],  # repeated
    [1, 5, 105],  # out of range
])
@pytest.mark.parametrize("form", FORMS)
def test_rollback_path_not_a_branch_raises(model, nodes, form):
    tokens = random_tokens(len(BRANCHES), seed=4)
    lm = CachedLM(model)
    lm.forward(PROMPT)
    tree_pass(lm, ROOT, tokens, BRANCHES)
    root = len(PROMPT)
    before = list(lm.ids)
    with pytest.raises(ValueError, match="not a branch"):
        keep_branch(lm, root, [root + 1 + j for j in nodes], form)
    assert lm.ids == before
    # nothing was moved or cropped: a valid rollback still gives the right cache
    lm.rollback(root, [root, root + 2, root + 6])
    committed = PROMPT + [ROOT, tokens[1], tokens[5]]
    assert lm.ids == committed
    torch.testing.assert_close(lm.forward([77])[-1], chain_logits(model, committed + [77]), **TOL)


def test_rollback_path_must_hang_off_length(model):
    tokens = random_tokens(len(BRANCHES), seed=4)
    lm = CachedLM(model)
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


def test_sliding_window_model_refuses_trees_but_chains_work():
    model = tiny_sliding_model()
    lm = CachedLM(model)
    text = list(range(30, 60))  # 30 tokens: past the window of 16
    lm.forward(text[:20])
    with pytest.raises(SpecDecodeError, match="sliding"):
        lm.forward([ROOT, 11, 12], parents=[19, 20, 20])
    assert lm.ids == text[:20]
    lm.forward(text[20:])  # chain forward still works after the refusal
    lm.rollback(12)
    assert lm.ids == text[:12]
    torch.testing.assert_close(lm.forward([77])[-1], chain_logits(model, text[:12] + [77]), **TOL)
    lm.rollback(5)
    torch.testing.assert_close(lm.forward([78, 79])[-1], chain_logits(model, text[:5] + [78, 79]), **TOL)


def test_rollback_length_inside_the_tree_keeps_the_branch():
    """rollback(length, path) where `length` runs past the trunk into the tree: the tree part of the
    prefix is treated as the start of the branch."""
    model = tiny_model(0)
    prompt = [5, 17, 42, 99, 3, 8, 9]
    lm = CachedLM(model)
    lm.forward(prompt)
    root, a, b, c, a1 = 77, 11, 12, 13, 14
    lm.forward([root, a, b, c, a1], parents=[6, 7, 7, 7, 8])  # a1 is the child of a
    lm.rollback(9, [11])  # keep prompt + root + a, then a1
    assert lm.ids == prompt + [root, a, a1]
    got = lm.forward([50])[-1]
    want = CachedLM(model).forward(prompt + [root, a, a1, 50])[-1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
