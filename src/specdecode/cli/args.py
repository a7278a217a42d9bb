"""The argument groups the commands share, one function per group: the models (--target, --draft, --dtype,
--device), the backend, lookup sources, speculation (--method, --gamma, the tree's dimensions) and sampling.
generate and apply take all of them; serve and bench the groups they share with generate. No torch here: every
command's parser is built before anything loads it."""

from __future__ import annotations

DTYPES = ["bf16", "fp32", "fp16"]


def models_args(parser) -> None:
    """--target, --draft, --dtype, --device: the models a command loads."""
    parser.add_argument(
        "--target",
        default=None,
        help="built-in name, HF directory, .gguf file or hub id (default: qwen2.5-coder-1.5b-instruct)",
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="draft model, same forms (default with the default target: qwen2.5-coder-0.5b-instruct)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="default: bf16 where the hardware supports it natively, else fp32"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def model_args(parser) -> None:
    """The models a command loads and how: models_args, backend_args and lookup_args."""
    models_args(parser)
    backend_args(parser)
    lookup_args(parser)


def gamma_arg(parser, help: str | None = None) -> None:
    from ..methods import DEFAULT_GAMMA

    parser.add_argument(
        "--gamma",
        type=int,
        default=DEFAULT_GAMMA,
        help=help or f"draft tokens per target pass (default {DEFAULT_GAMMA})",
    )


def method_args(parser, help: str | None = None) -> None:
    """--method and --gamma: a command's (or a server's default) speculation."""
    from ..methods import DEFAULT_METHOD, help_text, method_names

    parser.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=help or help_text())
    gamma_arg(parser)


def speculation_args(parser) -> None:
    """--method, --gamma and the tree's dimensions: how a command's generations speculate."""
    method_args(parser)
    tree_args(parser)


def sampling_args(parser, max_new_tokens: int | None = 128, help: str | None = None) -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p, --seed."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=help)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def backend_args(parser) -> None:
    """--backend, --route, --threads, the draft's form (--draft-quant, --draft-vocab, --draft-window), --exact."""
    from ..backends import BACKENDS, DRAFT_QUANT_CHOICES
    from ..drafters import DRAFT_WINDOW

    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto (default): GGUF models on the CPU run on llama.cpp, the rest on torch",
    )
    parser.add_argument(
        "--route",
        action="store_true",
        help="a GGUF target on llama.cpp and also on torch in bf16 (where this CPU's bf16 passes "
        "measure flat and memory allows), each request run whole on the one its measured costs "
        "predict faster (an edit with a prediction: often torch; a chat: llama.cpp)",
    )
    parser.add_argument(
        "--remeasure-route",
        action="store_true",
        help="with --route: time this machine again (the bf16 probe, the prompt reads) instead of "
        "reading the results cached under the cache directory for this machine and model",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    parser.add_argument(
        "--draft-quant",
        choices=DRAFT_QUANT_CHOICES,
        default="auto",
        help="llama.cpp: run the draft in its fastest type here (auto, measured once), keep the "
        "file's (none) or force one; the draft never changes the output's law",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="K",
        help="torch: keep only the K most frequent tokens in the draft's output layer (FR-Spec; "
        "frequencies from --draft-vocab-from or --datastore); a lighter draft, same output",
    )
    parser.add_argument(
        "--draft-vocab-from",
        default=None,
        metavar="DIR",
        help="the datastore whose token frequencies choose --draft-vocab's tokens",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="exact greedy mode: every token's logits bit-identical to plain decoding's, so the output "
        "is plain decoding's token for token (llama.cpp: flash attention on; passes kept to the "
        "sizes measured exact here; see the README)",
    )
    parser.add_argument(
        "--draft-window",
        type=int,
        default=DRAFT_WINDOW,
        metavar="N",
        help=f"the draft model sees about the last N tokens of the text (default {DRAFT_WINDOW}; 0: "
        "all of it): on a long prompt it reads a window, not the whole prompt; the output is the "
        "same",
    )


def lookup_args(parser, history: bool = False, history_default: int = 0) -> None:
    """--datastore, and with `history` --history-tokens."""
    parser.add_argument(
        "--datastore",
        default=None,
        metavar="DIR",
        help="a datastore built by `specdecode index`: the lookup, tree and auto methods draft from it",
    )
    if history:
        parser.add_argument(
            "--history-tokens",
            type=int,
            default=history_default,
            help=f"earlier outputs remembered for the lookup drafter (default {history_default:,} "
            "tokens, least recently used dropped first; 0: none, and output then never depends "
            "on earlier requests)",
        )


def tree_args(parser) -> None:
    t = parser.add_argument_group("method tree (each unset dimension is chosen by the cost model)")
    t.add_argument("--tree-width", type=int, default=None, help="children per node and nodes expanded per depth")
    t.add_argument("--tree-depth", type=int, default=None, help="depth of the tree (draft passes)")
    t.add_argument("--tree-nodes", type=int, default=None, help="draft tokens verified per target pass")


def tree_kwargs(args) -> dict:
    kw = {f"tree_{k}": getattr(args, f"tree_{k}") for k in ("width", "depth", "nodes")}
    return {k: v for k, v in kw.items() if v is not None}
