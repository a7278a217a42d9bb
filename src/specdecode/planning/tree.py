"""Token trees: the drafter guesses many branches, the target verifies them all in ONE pass.

Growth follows EAGLE-2: from the root, each depth expands the frontier nodes with the highest value
(the estimated probability that the target accepts the whole path to them) by one batched draft
pass over the frontier, under a tree attention mask. Lookup guesses (drafters/lookup.py: the context, earlier
outputs, a datastore) join as extra branches, valued by a calibration of their observed frequency.
Greedy trees are then re-ranked: the N most valuable nodes are kept (a node is never worth more
than its parent, so they form a tree).

Shape (planner.py): with a CostModel (measured pass costs) each choice (expand one more depth, how
many frontier nodes, how many nodes to verify) maximises expected tokens per second,
(1 + sum of kept values) / (draft time + target time for N+1 tokens); a width/depth/nodes given
by hand fixes that dimension. When speculation does not pay (modelled rate below plain decoding)
the drafter stops running the draft model for a while (lookup, free to draft, still proposes when it
pays) and then tries again. Node values come from calibration.py, learned from every verdict.

Lossless sampling (verify_tree's contract): a greedy tree is all one-hot nodes, which may be chosen
and pruned by any draft-side rule. With temperature > 0 the children of an expanded node are
drawn from the draft's q without replacement (child i's q row is q without its earlier siblings,
renormalized); how many children a node gets is fixed before they are drawn, and drawn nodes are
never pruned, so the target's distribution is kept exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..drafters import Draft
from ..drafters.lookup import Guess, Lookup
from ..sampling import SamplingParams, probs_from_logits, sample
from .calibration import lookup_feature
from .costs import CostModel
from .planner import (  # noqa: F401
    AUTO_MARGIN,
    MASS_COVER,
    MAX_DEPTH,
    MAX_NODES,
    MAX_WIDTH,
    TreeState,
    best_cut,
    chain_speedup,
    draft_model_can_pay,
    frontier_width,
    pays,
)

MAX_LOOKUP_NODES = 24  # lookup guesses offered to the planner per source and step (it keeps those that pay)
LONG_CATCHUP = 512  # unread tokens from which the draft model's catch-up waits for the generation's first tokens
CATCHUP_WAIT = 16  # tokens a generation writes before that catch-up may be paid
MAX_COPY_DEPTH = 127  # a followed copy's chain (drafters/copy.py) may go this deep (a pass of 128 tokens, the largest
# the cost model times), where the measured passes pay
MAX_PASS_S = 1.5  # the longest modelled pass a copy is verified in: a longer one is a pause in a stream (a client
# waits that long for its next token), so at long contexts a copy rides passes of fewer tokens; on a machine whose
# plain step is slow, a pause of MAX_PASS_STEPS steps is allowed (the stream is slow there anyway)
MAX_PASS_STEPS = 24
RIDE_MARGIN = 1.2  # a step rides the copy alone (no tree, no draft model) when its chain's modelled rate beats
# plain decoding's by this much; below it the copy's guesses join the tree like other lookup guesses


@dataclass
class Node:
    """A guessed token. Index spaces: a node's index in TreeDrafter.nodes (its parent's too, -1 = the last
    committed token); `cache`: its entry in the draft model's KV cache; in the Draft sent to the target
    the kept nodes are renumbered 0..n-1, and the target's probability row after node i is p[i + 1]."""

    token: int
    parent: int  # node index, -1 = root
    depth: int
    value: float  # estimated P(target accepts the path to this node)
    conf: float | None  # draft probability of token given its parent (None: a lookup guess)
    rank: int = 0  # among its siblings from the draft model: 0 = the draft's first choice
    q: torch.Tensor | None = None  # [V] the distribution it was drawn from; None = one-hot
    cache: int | None = None  # index in the draft model's cache once it went through a draft pass
    lookup: float | None = None  # a lookup guess's calibration feature
    source: str = "draft"  # where the token came from: the draft model or a lookup source
    guess: Guess | None = None


class TreeDrafter:
    def __init__(
        self,
        draft_model=None,
        *,
        pld: bool = True,
        width: int | None = None,
        depth: int | None = None,
        nodes: int | None = None,
        adaptive: bool = True,
        costs: CostModel | None = None,
        state: TreeState | None = None,
        lookup: Lookup | None = None,
        chains_only: bool = False,
        lazy: bool = False,
        remaining: int | None = None,
    ):
        """pld: add lookup guesses (from `lookup`, by default the context only). chains_only: one child
        per node (width 1, and lookup guesses only where no other child is), for models that cannot
        run token trees. lazy (the auto method): the draft model reads the text only when a step runs it,
        and a step runs it only when what it is expected to save over the rest of the generation
        (`remaining` tokens) pays for the text it must read first (_model_pays)."""
        self.chains_only = chains_only
        if chains_only:
            width = 1
        self.model = draft_model
        self.lookup = (lookup if lookup is not None else Lookup()) if pld else None
        # a shape fixed in every dimension is taken as given: no planning, no backing off
        self.adaptive = adaptive and costs is not None and None in (width, depth, nodes)
        self.fixed_width, self.fixed_depth, self.fixed_nodes = width, depth, nodes
        self.width = width or MAX_WIDTH
        self.max_depth = depth or MAX_DEPTH
        self.max_nodes = nodes or (MAX_NODES if width is None or depth is None else 10**6)
        # a followed copy (a prediction, the prompt) is verified as one chain, so it needs no tree-node ids
        # (within a depth or node count given by hand)
        self.copy_depth = (
            min(MAX_COPY_DEPTH, depth or MAX_COPY_DEPTH, nodes or MAX_COPY_DEPTH)
            if self.lookup is not None and self.lookup.copies
            else 0
        )
        self.draft_nodes: int | None = None  # tree nodes the draft model's cache may hold in one step (None: any)
        self.costs, self.state = costs, state or TreeState()
        self._now = costs  # the costs at the current context length (set each step)
        self.lazy, self.budget = lazy, remaining  # budget: the generation's new tokens (None: not known)
        self.written = 0  # tokens this generation has committed
        self.catchup_s = 0.0  # wall seconds of this step's draft catch-up (reading unseen text)
        self.nodes: list[Node] = []  # everything grown this step
        self.kept: list[Node] = []  # the nodes sent to the target, in Draft order
        self.spent = 0.0  # modelled draft seconds of the current step

    @property
    def remaining(self) -> int | None:
        """The generation's tokens still to come (None: not known)."""
        return None if self.budget is None else self.budget - self.written

    def limit(self, nodes: int, chains_only: bool) -> None:
        """At most `nodes` guesses per pass (exact mode's pass sizes), one child per node if chains_only."""
        self.max_nodes = min(self.max_nodes, nodes)
        self.max_depth = min(self.max_depth, nodes)
        self.copy_depth = min(self.copy_depth, nodes)
        if chains_only:
            self.chains_only, self.width = True, 1

    def limit_tree(self, nodes: int, draft_nodes: int | None = None) -> None:
        """At most `nodes` tree nodes per target pass and `draft_nodes` (default: `nodes`) in the draft model's cache
        in one step: the sequence ids a llama.cpp cache, or a batch slot's share of one, holds. A followed copy's
        chain runs on the committed text (no tree-node ids) and keeps its depth."""
        draft_nodes = nodes if draft_nodes is None else draft_nodes
        self.max_nodes = min(self.max_nodes, nodes)
        self.max_depth = min(self.max_depth, nodes, draft_nodes + 1)
        self.draft_nodes = draft_nodes if self.draft_nodes is None else min(self.draft_nodes, draft_nodes)

    @property
    def depth_cap(self) -> int:
        """The deepest a step may draft: a tree's depth, or a followed copy's chain."""
        return max(self.max_depth, self.copy_depth)

    def reset(self) -> None:
        if self.model is not None:
            self.model.reset()
        if self.lookup is not None:
            self.lookup.reset()

    def prefill(self, ids: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.prefill(ids)
        # lazily, or while backing off, the draft model reads the text only when it is next used
        if self.model is not None and not self.lazy and not (self.adaptive and self.state.plain_left > 0):
            self.model.prefill(ids)

    # -- one step -------------------------------------------------------------------------------
    def propose(self, ids: list[int], depth_cap: int, params: SamplingParams, generator=None) -> Draft:
        """depth_cap: the loop's cap on the depth (it never drafts what it cannot emit); the tree's own
        cap is max_depth."""
        st, max_depth = self.state, min(depth_cap, self.max_depth)
        self.nodes, self.spent, self.catchup, self.catchup_s = [], 0.0, 0.0, 0.0
        self._t0 = time.perf_counter()  # the step's wall time runs until commit (after the target's pass)
        if self.costs is not None:  # pass costs at this context length (the draft's: its own view's)
            self._now = self.costs.at(len(ids), self.model.seen(len(ids)) if self.model is not None else None)
        if self.copy_depth and self.costs is not None:
            ride = self._ride(ids, min(depth_cap, self.copy_depth))
            if ride is not None:
                return ride
        backing_off = self.model is not None and self.adaptive and st.plain_left > 0
        if backing_off:
            st.plain_left -= 1  # backing off: prompt lookup (free to draft) may still propose
        skip = backing_off or (self.model is not None and self.lazy and not self._model_pays(ids))
        # the draft model drafts only as deep as its own context holds (none once full: lookup goes on)
        model_depth = 0 if self.model is None or skip else min(max_depth, self.model.room(len(ids)))
        if model_depth:
            logits, fed = self.model.root(ids, read=self._read)
            if self.catchup_s:  # read apart: fed-1 tokens of catch-up, then the root token
                self.catchup = self._now.read(fed - 1)
                fed = 1
            self.spent += self._d(fed)
            self._root_index = len(self.model.lm) - 1
            frontier = [(-1, logits)]  # (node, draft logits after it)
            for depth in range(1, model_depth + 1):
                new = [i for parent, lg in frontier for i in self._children(parent, lg, depth, params, generator)]
                expand = self._next_frontier(new, params) if depth < model_depth else []
                if self.draft_nodes is not None:  # the draft's cache holds every node expanded this step
                    expand = expand[: max(0, self.draft_nodes - (len(self.model.lm) - self._root_index - 1))]
                if not expand:
                    break
                n0 = len(self.model.lm)
                logits = self.model.expand(
                    [self.nodes[i].token for i in expand], [self._cache_index(self.nodes[i].parent) for i in expand]
                )
                for j, i in enumerate(expand):
                    self.nodes[i].cache = n0 + j
                self.spent += self._d(len(expand))
                frontier = list(zip(expand, logits))
        if self.lookup is not None:
            self._add_lookup(ids, max_depth, params.greedy)
        return self._draft(self._select(params))

    def _ride(self, ids: list[int], depth: int) -> Draft | None:
        """The followed copy's chain alone, cut at the timed pass size where its modelled rate is best (the whole
        measured curve: on tiled kernels some sizes cost far less per token than their neighbours) among those no
        slower than MAX_PASS_S (or MAX_PASS_STEPS plain steps), if that rate beats plain decoding's by RIDE_MARGIN
        (decided before anything is drawn: the choice never depends on a draw)."""
        longest = max(MAX_PASS_S, MAX_PASS_STEPS * self._now.t(1))
        depth = min(depth, max((k for k in self._now.target if self._now.t(k) <= longest), default=1) - 1)
        chain = self.lookup.copy_chain(ids, depth) if depth > 0 else None
        if chain is None:
            return None
        rate, n, _ = best_cut(chain.values, self._now, 0.0, keep_all=False, max_nodes=depth, measured_only=True)
        if n == 0 or rate < RIDE_MARGIN / self._now.t(1):
            return None
        for j, (x, v) in enumerate(zip(chain.tokens[:n], chain.values[:n])):
            self._add(Node(x, j - 1, j + 1, v, None, source=chain.source))
        draft = self._draft(list(range(n)))
        draft.strategy = "copy"
        return draft

    def _read(self, run) -> None:
        t = time.perf_counter()
        run()
        self.catchup_s += time.perf_counter() - t

    def _model_pays(self, ids: list[int]) -> bool:
        """Whether this step should run the draft model (the auto method): a draft chain at the learned
        acceptance must beat plain decoding at this context by AUTO_MARGIN on the measured costs, and
        the seconds it is expected to save over the tokens still to come must exceed what reading the
        unseen text (the prompt, or what was written while it was not run) costs first. Those seconds are
        saved against this generation's own rate without the model so far (plain decoding's before any step):
        where it rides a copy of the prompt at several tokens a pass, a draft chain saves little or nothing. A long
        catch-up (a long prompt) waits for the generation's first CATCHUP_WAIT tokens: an edit's answer starts
        with a few tokens of its own and then copies the prompt, which plain decoding's rate cannot foretell."""
        now = self._now
        speedup = chain_speedup(now, self.state.draft_alpha())
        if speedup <= AUTO_MARGIN:
            return False
        left = self.remaining if self.remaining is not None else MAX_DEPTH
        without = max(1 / now.t(1), self.state.generation_rate(False) or 0.0)
        saved = left * max(0.0, 1 / without - now.t(1) / speedup)
        unread = max(0, self.model.unread(len(ids)) - 1)
        if unread >= LONG_CATCHUP and self.written < CATCHUP_WAIT:
            return False
        return saved > now.read(unread) if unread else True

    def _children(self, parent: int, logits: torch.Tensor, depth: int, params: SamplingParams, generator) -> list[int]:
        v_parent = 1.0 if parent < 0 else self.nodes[parent].value
        made = []
        if params.greedy:  # deterministic children: the draft's top-k, confidence from its softmax
            conf = torch.softmax(logits.float(), -1)
            top = conf.topk(self.width)
            for r, (c, x) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                made.append(self._add(Node(x, parent, depth, v_parent * self.state.draft[min(r, 1)](c), c, r)))
        else:  # drawn children: how many is fixed from q alone, before drawing
            q = probs_from_logits(logits, params)
            k = self.width
            if self.fixed_width is None:
                k = self._drawn_children(q, v_parent)
            # the budget caps drawn nodes up front (never by pruning what was drawn)
            k = min(k, int((q > 0).sum()), self.max_nodes - len(self.nodes))
            rest = q
            for r in range(k):
                x = int(sample(rest, generator))
                c = float(q[x])
                made.append(self._add(Node(x, parent, depth, v_parent * self.state.draft[min(r, 1)](c), c, r, rest)))
                if r + 1 < k:  # the next sibling's q: without the ones drawn so far
                    rest = rest.clone()
                    rest[x] = 0.0
                    rest = rest / rest.sum()
        return made

    def _drawn_children(self, q: torch.Tensor, v_parent: float) -> int:
        """How many children to draw from q, decided before drawing: while the next one (valued as
        if it were q's next most likely token) raises the expected rate; without a cost model,
        enough to cover most of q's mass."""
        top = q.topk(self.width).values.tolist()
        if not self.adaptive:
            return min(self.width, sum(m < MASS_COVER for m in torch.tensor(top).cumsum(0).tolist()) + 1)
        e = 1.0 + sum(nd.value for nd in self.nodes)
        n = len(self.nodes)
        k = 0
        for r, c in enumerate(top):
            v = v_parent * self.state.draft[min(r, 1)](c)
            if not pays(self._now, self.spent, e, n, v):
                break
            e, n, k = e + v, n + 1, k + 1
        return k

    def _cache_index(self, parent: int) -> int:
        return self._root_index if parent < 0 else self.nodes[parent].cache

    def _add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _next_frontier(self, new: list[int], params: SamplingParams) -> list[int]:
        ranked = sorted(new, key=lambda i: -self.nodes[i].value)[: self.width]
        if not params.greedy and len(self.nodes) + self.width > self.max_nodes:
            return []  # drawn nodes are never pruned: stop growing at the budget
        if not self.adaptive or self.fixed_depth is not None and self.fixed_width is not None:
            return ranked
        w = frontier_width(
            [self.nodes[i].value for i in ranked],
            self._now,
            self.spent,
            self._best(params),
            self._d,
            self.state.rho,
            self.fixed_width,
            must_expand=self.fixed_depth is not None,
        )
        return ranked[:w]

    def _ranked(self) -> list[int]:
        return sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].value, self.nodes[i].depth, i))

    def _best(self, params: SamplingParams) -> tuple[float, int, float]:
        """(rate, N, expected tokens) of the best tree that can be cut from the nodes so far."""
        values = [self.nodes[i].value for i in self._ranked()]
        return best_cut(values, self._now, self.spent, keep_all=not params.greedy, max_nodes=self.max_nodes)

    def _add_lookup(self, ids: list[int], max_depth: int, greedy: bool) -> None:
        """Join the lookup guesses to the tree (a guess equal to a node already there merges into it)."""
        where: list[int | None] = []  # guess -> its tree node (None: left out, with its subtree)
        # up to 72 guesses a step: the first node at each (parent, token), and the nodes' summed value
        # (summed again only once a node joins), rather than a scan of all nodes per guess
        first: dict[tuple[int, int], int] = {}
        for i, nd in enumerate(self.nodes):
            first.setdefault((nd.parent, nd.token), i)
        total = None
        for g in self.lookup.tree(ids, max_depth, MAX_LOOKUP_NODES):
            parent = -1 if g.parent < 0 else where[g.parent]
            where.append(None)
            if parent is None:  # (continuations stop at max_depth)
                continue
            if not greedy and len(self.nodes) >= self.max_nodes:  # (a greedy tree is cut to size later)
                continue
            if (parent, g.token) in first:
                where[-1] = first[parent, g.token]
                continue
            if self.chains_only and any(nd.parent == parent for nd in self.nodes):
                continue  # chains only: one child per node
            feature = lookup_feature(g) if g.value is None else None  # a followed copy values its own guesses
            value = (1.0 if parent < 0 else self.nodes[parent].value) * (
                g.value if feature is None else self.state.lookup(feature)
            )
            # one-hot, so droppable; but a sampled tree is not cut later, so decide now
            if not greedy and self.adaptive:
                total = sum(nd.value for nd in self.nodes) if total is None else total
                if not pays(self._now, self.spent, 1.0 + total, len(self.nodes), value):
                    continue
            where[-1] = first[parent, g.token] = self._add(
                Node(g.token, parent, g.depth, value, None, lookup=feature, source=g.source, guess=g)
            )
            total = None

    def _select(self, params: SamplingParams) -> list[int]:
        if not params.greedy:
            return list(range(len(self.nodes)))
        ranked = self._ranked()
        if self.adaptive and self.fixed_nodes is None:
            n = self._best(params)[1]
        else:
            n = min(self.max_nodes, len(ranked))
        return sorted(ranked[:n], key=lambda i: (self.nodes[i].depth, i))  # parents first, siblings in order

    def _draft(self, keep: list[int]) -> Draft:
        index = {old: new for new, old in enumerate(keep)}
        self.kept = [self.nodes[i] for i in keep]
        tokens = [nd.token for nd in self.kept]
        parents = [-1 if nd.parent < 0 else index[nd.parent] for nd in self.kept]
        q = None
        if any(nd.q is not None for nd in self.kept):
            V = next(nd.q for nd in self.kept if nd.q is not None).shape[-1]
            q = torch.stack(
                [
                    nd.q if nd.q is not None else torch.zeros(V).index_fill_(0, torch.tensor(nd.token), 1.0)
                    for nd in self.kept
                ]
            )
        chain = all(p == i - 1 for i, p in enumerate(parents))
        # the estimate is only as good as the calibration, which a tree engine keeps learning
        expected = modelled = None
        if self.costs is not None:
            expected = 1.0 + sum(nd.value for nd in self.kept)
            modelled = self.catchup + self.spent + self._now.t(len(tokens) + 1)
        strategy = (
            "plain"
            if not tokens
            else "lookup"
            if all(nd.conf is None for nd in self.kept)
            else "draft"
            if chain
            else "tree"
        )
        return Draft(
            tokens,
            q,
            None if chain else parents,
            expected,
            modelled,
            strategy,
            [nd.source for nd in self.kept],
            plain_s=self._now.t(1) if self.costs is not None else None,
            catchup_s=self.catchup_s,
        )

    def _d(self, k: int) -> float:
        return self._now.d(k) if self.costs is not None else 0.0

    # -- after the target's verdict ---------------------------------------------------------------
    def commit(self, length: int, path: list[int], bonus: int) -> None:
        """ids[:length], the kept nodes `path` and then `bonus` now stand: learn from the verdict and
        compact the draft cache."""
        self.state.learn(self.nodes, [self.kept[i].token for i in path] + [bonus])
        kept = self.kept
        if self.lookup is not None:
            self.lookup.accepted([kept[i].guess for i in path if kept[i].guess is not None])
        self.written += len(path) + 1
        if self.model is not None:
            branch = []
            for i in path:  # the accepted nodes that went through a draft pass: a prefix of the path
                if kept[i].cache is None:
                    break
                branch.append(kept[i].cache)
            self.model.keep_branch(length, branch)
        if self.adaptive and self.model is not None:
            used = bool(self.spent)  # this step ran the draft model
            # the step's own seconds: catching up is paid once, and was weighed before running the draft
            modelled_s = self.spent + self._now.t(len(kept) + 1)  # the step's drafting and verification
            self.state.record_step(used, len(path) + 1, time.perf_counter() - self._t0 - self.catchup_s, modelled_s)
            if used:
                self.state.learn_rate((len(path) + 1) / modelled_s, 1.0 / self._now.t(1))
        self.kept, self.nodes = [], []
