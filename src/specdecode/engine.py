"""The Engine: the facade that loads the models once and runs generations through the loop (loop.py:
draft -> verify -> accept -> roll back) with the drafter each method builds (methods.py)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterator

import torch

from .backends import as_lm, torch_threads_for
from .builders import Parts
from .checks import check_request, positive_int
from .drafters import DRAFT_WINDOW, Datastore, DraftModel, History, check_compatible, tokenizer_fingerprint
from .errors import InvalidField, SpecDecodeError
from .exactness import ExactLimits, limits as measured_exact_limits, padding
from .lease import Lease, TokenizerCopies, tokenizer_lock
from .loop import speculative_decode
from .methods import DEFAULT_GAMMA, DEFAULT_METHOD, METHOD_TABLE, NO, DraftRequest, get_method, method_names
from .prefill import Interrupt, cache_kept_for_reuse, interruptible, text_budget
from .request import Encoded, Request
from .stats import Generation, Stats
from .textstream import TextStream

METHODS = method_names()  # the names in methods.METHOD_TABLE, which says what each needs


class Engine:
    """Load the models once, generate many times.

    >>> engine = Engine.load()                       # default pair, converted once and cached
    >>> out = engine.generate("def fib(n):", method="draft", gamma=4, max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted_tokens
    >>> for delta in engine.stream("Hello", method="pld"): print(delta, end="")

    What holds (docs/guide/guarantees.md): sampled output has exactly the target's distribution; greedy output is
    plain decoding's except at near-ties of the target's top two logits (a k-token pass rounds differently from a
    1-token one); with exact=True, plain decoding's bit for bit.

    A draft model whose context is shorter than the target's drafts only while the text fits in it (then
    the target goes on plainly, lookup guesses kept): the output is the same; only the speedup ends.

    With history_tokens > 0 the engine remembers its earlier outputs (that many tokens, least recently
    used dropped first) and the lookup, tree and auto methods draft from them too; outside exact mode a
    near-tie can then fall the other way (certify). history_tokens=0: the default (`serve`: one per API key).
    datastore: a directory built by `specdecode index` (same tokenizer), drafted from by the same methods.
    """

    def __init__(
        self,
        target_model,
        tokenizer,
        draft_model=None,
        draft_tokenizer=None,
        *,
        history_tokens: int = 0,
        datastore: str | None = None,
        draft_window: int | None = DRAFT_WINDOW,
        exact: bool = False,
        prompt_cache: bool = False,
    ):
        self.tokenizer = tokenizer
        self.encoder = tokenizer  # what requests' text is encoded with (separate_encoder: a copy of its own)
        self.exact = bool(exact)  # the default of stream()/generate()'s exact
        self.prompt_cache = bool(prompt_cache)  # a prompt reads only what the last one's cached text lacks (prefill)
        self.target = as_lm(target_model)  # an HF model (wrapped as a CachedLM) or an LM such as a LlamaLM
        self.vocab_size = self.target.vocab_size
        self.draft_model = None
        if draft_model is not None:
            check_compatible(tokenizer, draft_tokenizer if draft_tokenizer is not None else tokenizer)
            if draft_window is not None:
                positive_int("draft_window", draft_window)
            self.draft_model = DraftModel(draft_model, self.vocab_size, draft_window)
        eos = tokenizer.eos_token_id
        self.eos_ids = self.target.eos_token_ids | self.target.eog_ids | ({eos} if isinstance(eos, int) else set())
        self.costs = None  # the tree method's CostModel, measured (or read from the cache) on first use
        self._exact_limits = None  # exact mode's ExactLimits, likewise
        self.progress = True
        self.lease = Lease()  # one generation at a time: the models hold one KV cache each (lease.py)
        self.history = History(history_tokens) if history_tokens else None
        self.datastore = None
        if datastore is not None:
            self.use_datastore(datastore)

    def separate_encoder(self, copies: int = 1) -> None:
        """Encode requests on `copies` copies of the tokenizer from now on (lease.TokenizerCopies: each encoding takes a
        free one), so a server's handlers encoding big requests never hold up the generation that decodes on the
        engine's own, nor, up to `copies` at once, each other."""
        if self.encoder is self.tokenizer:
            try:
                self.encoder = TokenizerCopies(self.tokenizer, copies)
            except Exception:  # noqa: BLE001 (a tokenizer that cannot be copied: shared, under its one lock)
                self.encoder = self.tokenizer

    def use_datastore(self, path: str | None) -> None:
        """Draft from this datastore from now on (None: from none); it must share the tokenizer."""
        self.datastore = None if path is None else Datastore(path, tokenizer_fingerprint(self.tokenizer))

    def truncate_draft_vocab(self, k: int, source: str | None = None) -> int:
        """FR-Spec: keep the k most frequent tokens of a datastore (source, default: the engine's own)
        in the draft's output layer, plus every special token (EOS and the tokenizer's added tokens).
        Returns the number of rows kept."""
        if self.draft_model is None:
            raise SpecDecodeError("--draft-vocab needs a draft model")
        if source is None and self.datastore is None:
            raise SpecDecodeError(
                "--draft-vocab needs token frequencies: --draft-vocab-from DIR (a datastore built "
                "by `specdecode index` from a corpus like your prompts) or --datastore DIR"
            )
        ds = self.datastore if source is None else Datastore(source, tokenizer_fingerprint(self.tokenizer))
        added = set(self.tokenizer.get_added_vocab().values())
        keep = set(ds.top_tokens(k)) | self.eos_ids | added
        self.draft_model.truncate([i for i in keep if i < self.vocab_size])
        return len(self.draft_model.keep)

    @classmethod
    def load(
        cls,
        target: str | None = None,
        draft: str | None = None,
        *,
        backend: str = "auto",
        dtype: str | None = None,
        device: str | None = None,
        with_draft: bool = True,
        progress: bool = True,
        threads: int | None = None,
        draft_quant: str = "auto",
        history_tokens: int = 0,
        datastore: str | None = None,
        draft_vocab: int | None = None,
        draft_vocab_from: str | None = None,
        draft_window: int | None = DRAFT_WINDOW,
        exact: bool = False,
        prompt_cache: bool = False,
    ) -> "Engine":
        """target/draft: a built-in name, a local HF directory, a GGUF file or a hub id.
        Without arguments: the default pair (Qwen2.5-Coder 1.5B target, 0.5B draft).
        backend: "auto" (a GGUF model on the CPU runs on llama.cpp, anything else on torch),
        "torch" or "llama.cpp" (routing.Router.load: a GGUF target on both, each request on the faster).
        draft_quant (llama.cpp): "auto" runs the draft in whichever of its file's type, Q4_0 and Q8_0 is fastest
        on this machine (the draft never changes the output's law), "none" keeps the file, "Q4_0"/"Q8_0" force
        one. history_tokens, datastore: see Engine.
        draft_vocab (torch): truncate the draft's output layer to this many most frequent tokens of
        draft_vocab_from (a datastore; default: datastore), see truncate_draft_vocab. draft_window: the
        draft model sees only about the last this many tokens (None: the whole text), see DraftModel.
        exact: load the target for exact greedy mode and make it every greedy generation's default (see
        stream); on llama.cpp the target then runs with flash attention on (see exactness.py). prompt_cache: see
        Engine (prefill.py)."""
        from .backends.loading import DEFAULT_DRAFT, DEFAULT_TARGET, check_draft_vocab, load_draft_lm, load_lm

        if target is None:
            target = DEFAULT_TARGET
            draft = draft or DEFAULT_DRAFT
        if threads is not None:
            positive_int("threads", threads)
        if draft_vocab is not None:  # before loading anything
            positive_int("draft_vocab", draft_vocab)
            if draft:
                check_draft_vocab(draft, backend, device)
            if draft_vocab_from is None and datastore is None:
                raise SpecDecodeError(
                    "--draft-vocab needs token frequencies: --draft-vocab-from DIR (a datastore "
                    "built by `specdecode index`) or --datastore DIR"
                )
        t_model, t_tok, t_backend = load_lm(
            target, backend, dtype=dtype, device=device, progress=progress, threads=threads, exact=exact
        )
        d_model = d_tok = None
        if with_draft and draft:
            d_model, d_tok, d_backend = load_draft_lm(
                draft, backend, dtype=dtype, device=device, progress=progress, threads=threads, quant=draft_quant
            )
        engine = cls(
            t_model,
            t_tok,
            d_model,
            d_tok,
            history_tokens=history_tokens,
            datastore=datastore,
            draft_window=draft_window,
            exact=exact,
            prompt_cache=prompt_cache,
        )
        engine.progress = progress
        if draft_vocab is not None and engine.draft_model is not None:
            engine.truncate_draft_vocab(draft_vocab, draft_vocab_from)
        return engine

    @property
    def backend(self) -> str:
        return self.target.backend

    def exact_limits(self) -> ExactLimits:
        """Exact mode's pass sizes for this target: measured once per machine (cached on disk), read once here."""
        if self._exact_limits is None:
            with self.lease.held("measuring exact pass sizes"):
                self._exact_limits = measured_exact_limits(self.target, self.progress)
        return self._exact_limits

    def tree_costs(self):
        """The tree method's CostModel: pass costs measured once per machine and models (cached on disk)."""
        if self.costs is None:
            from .planning.costs import load_or_measure

            with self.lease.held("measuring pass costs"):
                self.costs = load_or_measure(
                    self.target, self.draft_model.lm if self.draft_model else None, progress=self.progress
                )
        return self.costs

    # -- text in, text out -------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            chat, messages = True, prompt
        elif isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            raise InvalidField(
                f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}", param="prompt"
            )
        if chat:
            if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise InvalidField(
                    "chat messages must be a non-empty list of {'role': ..., 'content': str}", param="prompt"
                )
            if not any(m["content"].strip() for m in messages):
                raise InvalidField("the prompt is empty", param="prompt")
            if getattr(self.encoder, "chat_template", None) is None:
                raise InvalidField("this tokenizer has no chat template; pass a plain prompt instead", param="prompt")
            with tokenizer_lock(self.encoder):
                text = self.encoder.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = prompt
        if not text:
            raise InvalidField("the prompt is empty", param="prompt")
        # a chat template writes its own special tokens; a raw prompt gets the model's (e.g. BOS)
        with tokenizer_lock(self.encoder):
            ids = self.encoder(text, add_special_tokens=not chat)["input_ids"]
        if not ids:
            raise InvalidField("the prompt is empty after tokenization", param="prompt")
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        with tokenizer_lock(self.tokenizer):  # a server's handlers encode on their own copy (separate_encoder)
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_prediction(self, prediction: str | None) -> tuple | None:
        """A predicted output as the tokens it drafts from (no special tokens: it continues the prompt)."""
        if prediction is None:
            return None
        if not isinstance(prediction, str):
            raise InvalidField(f"prediction must be a string, got {type(prediction).__name__}", param="prediction")
        if not prediction:
            return None
        with tokenizer_lock(self.encoder):
            return tuple(self.encoder(prediction, add_special_tokens=False)["input_ids"])

    def encode_request(self, request: Request) -> Encoded:
        """The request checked (without models) and its prompt and prediction tokenized: the ids that every engine
        sharing this tokenizer opens it with (a router's choice, a batch slot's engine)."""
        self.check(**request.checked_fields())  # before tokenizing
        prompt_ids = tuple(self.encode(request.prompt, request.chat))
        return Encoded(request, prompt_ids, self.encode_prediction(request.prediction) or None)

    def generate(self, prompt: str | list[dict], **kwargs) -> Generation:
        """The whole generation (stream's arguments)."""
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: str | list[dict],
        *,
        method: str = DEFAULT_METHOD,
        gamma: int = DEFAULT_GAMMA,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        chat: bool = False,
        tree_width: int | None = None,
        tree_depth: int | None = None,
        tree_nodes: int | None = None,
        exact: bool | None = None,
        history=None,
        cache_scope: str = "",
        prediction: str | None = None,
    ) -> TextStream:
        """An iterator of text deltas (never splitting a character or leaking a stop string);
        after it is exhausted, .result holds the Generation.

        method="auto" (the default): each step the cost model measured here picks plain decoding, prompt
        lookup, a draft chain or a tree, whichever should give the most tokens per second (the draft model
        only where it could ever pay; chains only where a model cannot run trees: sliding-window layers,
        attention other than sdpa/eager, where method="tree" is an error before any model work).
        method="tree": gamma unused; tree_width (children per node and frontier nodes per depth),
        tree_depth and tree_nodes (nodes per pass) fix the shape where given, the cost model the rest.
        exact (greedy only; default: the Engine's, for greedy requests): every target pass is one whose
        logits are bit-identical to plain decoding's (exactness.py): plain decoding's output, token for token.
        history: the History this generation drafts from and adds its output to (default: the Engine's own).
        cache_scope: with the Engine's prompt_cache, whose text this is (the server: an API key's hash): the
        prompt reuses the target's cache only after a generation of the same scope; never in exact mode.
        prediction: the text the output is expected to be, mostly (OpenAI's Predicted Outputs: an edited file), or
        its tokens (encode_prediction's tuple): a source of guesses the target verifies like any other, never a
        forced output. The methods that draft from lookup sources (auto, lookup, tree) and pld follow it through
        the output's edits (drafters/copy.py); stats.sources["prediction"] counts its drafted and accepted tokens,
        stats.accepted/rejected_prediction_tokens OpenAI's usage fields (prediction.py), counted at the end."""
        return self.open(
            Request(
                prompt,
                method=method,
                gamma=gamma,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=stop,
                chat=chat,
                tree_width=tree_width,
                tree_depth=tree_depth,
                tree_nodes=tree_nodes,
                exact=exact,
                history=history,
                cache_scope=cache_scope,
                prediction=prediction,
            )
        )

    def open(self, request: Request | Encoded) -> TextStream:
        """The request as a stream, checked and set up but not started (stream() says what each field does). An
        Encoded request (encode_request, on an engine with the same tokenizer) is not tokenized again."""
        encoded = request if isinstance(request, Encoded) else self.encode_request(request)
        r = encoded.request
        params = self.check(**r.checked_fields())
        exact = (self.exact and params.greedy) if r.exact is None else r.exact  # the Engine's: greedy requests
        if exact and not params.greedy:
            raise InvalidField(
                "exact mode is for greedy decoding (temperature 0); sampling is exact in distribution", param="exact"
            )
        limits = self.exact_limits() if exact else None
        m = METHOD_TABLE[r.method]
        prompt_ids = list(encoded.prompt_ids)
        draft_request = DraftRequest(
            r.gamma,
            params,
            r.tree_width,
            r.tree_depth,
            r.tree_nodes,
            r.max_new_tokens,
            self.history if r.history is None else r.history,
            encoded.prompt_ids,
            encoded.prediction_ids,
        )
        drafter = m.make_drafter(self.parts(), draft_request)
        stop_ids = self._stop_ids(r.stop)
        generator = torch.Generator()
        if r.seed is None:
            generator.seed()  # nondeterministic, and leaves torch's global RNG alone
        else:
            generator.manual_seed(r.seed)
        stats, depth_cap = self._stats(m, drafter, draft_request, len(prompt_ids), limits)
        scope = r.cache_scope if self.prompt_cache and limits is None else None  # exact: plain decoding's prefill
        interrupt = Interrupt()  # the stream's interrupt, asked while the prompt is read too
        steps = speculative_decode(
            self.target,
            drafter,
            prompt_ids,
            gamma=depth_cap,
            params=params,
            max_new_tokens=r.max_new_tokens,
            eos_ids=self.eos_ids | stop_ids,
            generator=generator,
            stats=stats,
            exact=limits,
            scope=scope,
            interrupt=interrupt,
        )
        draft = self.draft_model if m.needs_draft_model != NO else None
        budget = text_budget(
            self.target, len(prompt_ids), r.max_new_tokens, limits is not None or getattr(self.target, "exact", False)
        )
        around = self._surrounded(steps, draft_request.history, limits, scope, interrupt, draft, budget)
        return TextStream(self, around, stats, r.stops, interrupt, encoded=encoded, cache_scope=scope)

    def _stop_ids(self, stop) -> set[int]:
        """A stop string that is a special token never shows in the decoded text: the ids to stop on."""
        with tokenizer_lock(self.encoder):
            added = self.encoder.get_added_vocab()
        return {added[s] for s in ([stop] if isinstance(stop, str) else stop or []) if s in added}

    def _stats(self, m, drafter, request: DraftRequest, prompt_tokens: int, limits: ExactLimits | None):
        """A generation's Stats as its method describes it, and the depth one step may draft (a chain's length; a
        planned drafter's own depth cap, within the exact pass sizes where those hold)."""
        stats = Stats(method=m.name, gamma=request.gamma if m.uses_gamma else 0, prompt_tokens=prompt_tokens)
        depth_cap = request.gamma
        if m.planned:
            if limits is not None:  # plan within the exact pass sizes
                drafter.limit(max(limits.max_guesses, 1), chains_only=not limits.trees)
            depth_cap = drafter.depth_cap
        if m.uses_cost_model:
            stats.plain_step_s = self.costs.t(1, prompt_tokens)
        if m.shape is not None:
            stats.tree = m.shape(drafter, request)
        if m.uses_lookup_sources and drafter.lookup is not None:
            stats.lookup_sources = drafter.lookup.sources
        elif m.prompt_lookup:
            stats.lookup_sources = ["context"] + (["prediction"] if request.prediction_ids else [])
        return stats, depth_cap

    def _surrounded(
        self,
        steps: Iterator[list[int]],
        history: History | None,
        limits: ExactLimits | None,
        scope: str | None,
        interrupt: Interrupt,
        draft: DraftModel | None,
        budget: int,
    ) -> Iterator[list[int]]:
        """The loop's steps inside what surrounds a generation, entered at its first step in this order and left in
        the reverse however it ends (exhausted, an error, or closed between steps: a client gone). draft: the draft
        model the generation may run, its cache sized here for `budget` tokens of text as the target's is in prefill."""
        with ExitStack() as around:
            around.enter_context(self.lease.held("starting a second generation"))  # the models' one KV cache each
            around.enter_context(interruptible([self.target] + ([draft.lm] if draft is not None else []), interrupt))
            if draft is not None:
                draft.reserve(budget)
            around.enter_context(torch_threads_for(self.target))
            out: list[int] = []
            if history is not None:
                around.callback(history.add, out)  # its output (never the prompt), however it ends
            if limits is not None and limits.pad_rows > 1:  # exact mode's plain steps too run as padded passes
                around.enter_context(padding(self.target, limits.pad_rows))
            if scope is not None:
                around.enter_context(cache_kept_for_reuse(self.target))
            around.callback(steps.close)  # the loop first, inside all of the above
            for new in steps:
                out += new
                yield new

    check = staticmethod(check_request)  # the request's arguments, checked without models (checks.py)

    def parts(self) -> Parts:
        """What a generation's drafter is built from (builders.py): the pass costs are measured on first use."""
        return Parts(self.target, self.draft_model, self.tree_costs, self.datastore)

    def drafter(self, method: str, request: DraftRequest):
        """The drafter of one generation as methods.METHOD_TABLE builds it (the request checked by `check`)."""
        return get_method(method).make_drafter(self.parts(), request)
