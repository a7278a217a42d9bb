"""What one generation counted (Stats: passes, drafted and accepted tokens by position, strategy and
source, the cost model's predictions, timings) and what it returns (Generation)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .drafters import Draft
from .prediction import prediction_usage


def decode_rate(new_tokens: int, wall_s: float, ttft_s: float | None, first_tokens: int = 1) -> float | None:
    """Decoding speed without the prefill: the tokens after the first step's (first_tokens of them arrived
    at ttft_s), per second after it. None when there is nothing to measure."""
    if ttft_s is None or new_tokens <= first_tokens or wall_s <= ttft_s:
        return None
    return (new_tokens - first_tokens) / (wall_s - ttft_s)


@dataclass
class Stats:
    """Counters of one generation. target_forwards counts verify passes (the prefill is not one)."""

    method: str = "autoregressive"
    gamma: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, read from the cache an earlier generation left (Engine prompt_cache)
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # passes where a draft token was rejected (the rest were all accepted)
    accepted_per_position: list[int] = field(default_factory=list)  # passes that accepted a token at depth i+1
    drafted_per_position: list[int] = field(default_factory=list)  # passes that drafted to depth i+1 or deeper
    tree: dict | None = None  # the tree method's shape: caps, and which dimensions the cost model chose
    tree_depth: int = 0  # summed over passes (a chain's depth is its length)
    expected_tokens: float = 0.0  # the drafter's expected tokens per pass, summed over passes that had one
    planned_passes: int = 0
    modelled_s: float = 0.0  # the cost model's seconds for those passes (drafting + verification)
    plain_step_s: float | None = None  # the cost model's seconds of one plain decoding step (at the contexts
    # of the planned passes, weighted by their expected tokens)
    strategies: dict = field(default_factory=dict)  # target passes by what ran: plain, lookup, draft, tree
    # source -> {"drafted": n, "accepted": n}: draft, context, history, datastore
    sources: dict = field(default_factory=dict)
    lookup_sources: list = field(default_factory=list)  # the lookup sources this generation drew from
    # OpenAI's usage fields for a prediction (prediction.py): its tokens the output holds along their best alignment,
    # and those it does not (of those the output could reach); counted when the generation ends, 0 without one
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float | None = None  # seconds from the start of the stream to the first emitted token (prefill included)
    first_tokens: int = 0  # tokens the first step emitted (they arrive at ttft_s: not part of decoding)
    draft_s: float = 0.0
    catchup_s: float = 0.0  # of draft_s: the draft model reading text it had not seen (prompt, skipped steps)
    verify_s: float = 0.0
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    engine: str | None = None  # with several engines loaded (routing.Router): the one that ran this generation

    def __post_init__(self):
        # per target pass: [tokens it emitted, how many of them were accepted draft tokens (its first ones),
        # the sources of those, tokens it drafted]; not a field, so not in as_dict: what truncate() needs to take
        # back tokens cut at a stop string, and where each emitted token came from (`passes`)
        self._passes: list[list] = []
        self._plain_weighted = 0.0  # sum over planned passes of expected tokens x the plain step's seconds there

    @property
    def passes(self) -> list[list]:
        """Per target pass so far (the prefill's first token is the first): [tokens emitted, accepted draft tokens
        (the first emitted ones), their sources, tokens drafted]. Read only."""
        return self._passes

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Tokens emitted per target forward, bonus included (tau)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first step's, per second after it: decoding speed without the prefill."""
        return decode_rate(self.new_tokens, self.wall_s, self.ttft_s, self.first_tokens)

    @property
    def mean_tree_nodes(self) -> float | None:
        """Draft tokens verified per target pass (for a chain: its length)."""
        return self.drafted / self.target_forwards if self.target_forwards else None

    @property
    def expected_tokens_per_pass(self) -> float | None:
        return self.expected_tokens / self.planned_passes if self.planned_passes else None

    @property
    def predicted_speedup(self) -> float | None:
        """What the cost model predicted against plain decoding: (expected tokens / modelled seconds)
        x the modelled seconds of one plain step."""
        if not self.modelled_s or not self.plain_step_s:
            return None
        return self.expected_tokens / self.modelled_s * self.plain_step_s

    def record(self, draft: Draft, accepted: int, emitted: int | None = None, path: list[int] | None = None) -> None:
        """One target pass over `draft`: `accepted` draft tokens were accepted (and emitted): the nodes
        path[:accepted] (default: the first ones, a chain), and it emitted `emitted` tokens in all
        (default: those plus one of the target's own)."""
        sources = draft.sources or ["draft" if draft.q is not None else "context"] * len(draft.tokens)
        path = list(range(accepted)) if path is None else path[:accepted]
        for s in sources:
            self.sources.setdefault(s, {"drafted": 0, "accepted": 0})["drafted"] += 1
        for i in path:
            self.sources[sources[i]]["accepted"] += 1
        self._passes.append(
            [accepted + 1 if emitted is None else emitted, accepted, [sources[i] for i in path], len(draft.tokens)]
        )
        self.target_forwards += 1
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        depth = draft.depth
        self.tree_depth += depth
        self.rejections += accepted < depth
        if draft.expected is not None:
            self.expected_tokens += draft.expected
            self.planned_passes += 1
            self.modelled_s += draft.modelled_s or 0.0
            if draft.plain_s:
                self._plain_weighted += draft.expected * draft.plain_s
                self.plain_step_s = self._plain_weighted / self.expected_tokens
        self.catchup_s += draft.catchup_s
        strategy = draft.strategy or ("plain" if not draft.tokens else "tree" if draft.parents is not None else "draft")
        self.strategies[strategy] = self.strategies.get(strategy, 0) + 1
        grow = depth - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    def count_prediction(self, prediction: tuple, output: list[int]) -> None:
        """The prediction's usage fields against the generation's final output (after any stop string's cut): the
        whole prediction where the output ended on its own, as far as it could reach where it was cut."""
        self.accepted_prediction_tokens, self.rejected_prediction_tokens = prediction_usage(
            prediction, output, finished=self.finish_reason in ("eos", "stop")
        )

    def truncate(self, new_tokens: int) -> None:
        """The output was cut to its first new_tokens tokens (a stop string ended it): accepted draft
        tokens past the cut were never emitted, so they no longer count as accepted (in `accepted` and
        `accepted_per_position`). Drafted tokens and target passes stay: they were verified."""
        start = 0
        for p in self._passes:
            emitted, accepted, sources, drafted = p
            kept = min(accepted, max(0, new_tokens - start))  # accepted draft tokens come first in a pass
            for i in range(kept, accepted):
                self.accepted_per_position[i] -= 1
                self.sources[sources[i]]["accepted"] -= 1
            self.accepted -= accepted - kept
            p[:] = [min(emitted, max(0, new_tokens - start)), kept, sources[:kept], drafted]
            start += emitted
        self.new_tokens = new_tokens

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_tokens=self.mean_accepted_tokens,
            tokens_per_second=self.tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
            mean_tree_nodes=self.mean_tree_nodes,
            expected_tokens_per_pass=self.expected_tokens_per_pass,
            predicted_speedup=self.predicted_speedup,
        )
        return d


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: Stats

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.as_dict()}
