"""`specdecode apply FILE INSTRUCTION`: a local "fast apply". The file goes into a chat prompt and, fenced as the answer
should be, into the prediction (Predicted Outputs), so the lines the edit keeps are verified many tokens a pass; the
answer's code block is the new file, printed as a unified diff or written in place (text.py). The model runs here
(cli/load.py, with generate's arguments) or in a running `specdecode serve` (--server, client.py). No
torch at module level: the parser is built before anything loads it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cli.args import model_args, sampling_args, speculation_args, tree_kwargs
from ..cli.load import load_engine
from ..errors import SpecDecodeError
from .text import (
    NoCodeBlock,
    answer_budget,
    build_request,
    extract_block,
    match_final_newline,
    read_source,
    unified_diff,
    write_atomically,
)


def add_parser(sub) -> None:
    """`specdecode apply`"""
    a = sub.add_parser(
        "apply",
        help="edit a file as an instruction says, the file sent as the prediction: print the "
        "unified diff (or write the file with --write), then stats",
    )
    a.add_argument("file", help="the UTF-8 text file to edit")
    a.add_argument("instruction", help="what to change, in words ('-' reads it from stdin)")
    a.add_argument(
        "--write",
        action="store_true",
        help="replace the file (atomically, keeping the old one as FILE.orig) instead of printing the diff",
    )
    a.add_argument(
        "--compare",
        action="store_true",
        help="also run plain decoding (method autoregressive, no prediction) and print the measured speed-up",
    )
    a.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="send the request to a running `specdecode serve` (e.g. http://127.0.0.1:8000) through "
        "/v1/chat/completions instead of loading a model here",
    )
    a.add_argument("--model", default=None, help="with --server: the model id to ask for (default: the server's)")
    a.add_argument("--api-key", default=None, help="with --server: the bearer key (default: $SPECDECODE_API_KEY)")
    speculation_args(a)
    sampling_args(
        a,
        max_new_tokens=None,
        help="at most this many tokens in the answer (default: the file's tokens "
        "x 1.5 + 64, within the context; with --server: the server's default)",
    )
    model_args(a)
    a.set_defaults(run=apply_command)


@dataclass
class Reply:
    """One answer, from the local engine or a server: its text, why it ended, its stats (Stats.as_dict(), as the
    server's `speculation` field holds them) and the prediction's accepted and rejected tokens."""

    text: str
    finish: str | None
    stats: dict
    accepted: int = 0
    rejected: int = 0


def reply_of(answer: dict) -> Reply:
    """A server's chat completion (JSON) as a Reply: the usage's prediction tokens, the `speculation` stats."""
    try:
        choice = answer["choices"][0]
        text = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        raise SpecDecodeError(f"the server's answer is not a chat completion: {str(answer)[:200]}") from None
    details = (answer.get("usage") or {}).get("completion_tokens_details") or {}
    return Reply(
        text,
        choice.get("finish_reason"),
        answer.get("speculation") or {},
        details.get("accepted_prediction_tokens") or 0,
        details.get("rejected_prediction_tokens") or 0,
    )


def reply_of_generation(out) -> Reply:
    """An Engine's Generation as a Reply. The prediction's tokens as a server's usage counts them (OpenAI's meaning:
    those the answer holds, those it does not) where the stats hold those fields; else the drafter's counts (tokens
    drafted from the prediction that the target kept, and those it rejected)."""
    stats = out.stats.as_dict()
    if "accepted_prediction_tokens" in stats:
        accepted, rejected = stats["accepted_prediction_tokens"], stats["rejected_prediction_tokens"]
    else:
        src = stats["sources"].get("prediction", {"drafted": 0, "accepted": 0})
        accepted, rejected = src["accepted"], src["drafted"] - src["accepted"]
    return Reply(out.text, out.stats.finish_reason, stats, accepted, rejected)


def stats_line(reply: Reply, plain: Reply | None, where: str, greedy: bool = True) -> str:
    """One line: tokens, seconds, decode speed, the prediction's tokens, and plain decoding's speed beside it (measured
    with --compare, else the cost model's seconds of a plain step where the method planned with it)."""
    s = reply.stats
    rate = s.get("decode_tokens_per_second")
    parts = [
        f"apply: {s.get('new_tokens', 0)} tokens in {s.get('wall_s', 0.0):.2f}s "
        f"(first after {s.get('ttft_s') or 0.0:.2f}s), decode {_rate(rate)}",
        f"prediction: {reply.accepted} tokens accepted, {reply.rejected} rejected",
    ]
    if plain is not None:
        base = plain.stats.get("decode_tokens_per_second")
        same = (
            "" if not greedy else ", same answer" if plain.text == reply.text else ", its answer differs (a near-tie)"
        )
        parts.append(f"plain decoding {_rate(base)} (measured{same}): {_ratio(rate, base)}")
    elif s.get("plain_step_s"):
        base = 1.0 / s["plain_step_s"]
        parts.append(f"plain decoding ~{base:.2f} tok/s (the cost model's): ~{_ratio(rate, base)}")
    else:
        parts.append("plain decoding: --compare measures it")
    return " | ".join(parts + [where])


def _rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.2f} tok/s"


def _ratio(rate: float | None, base: float | None) -> str:
    return "n/a" if not rate or not base else f"{rate / base:.2f}x"


def run_local(args, messages: list[dict], prediction: str) -> tuple[Reply, Reply | None, str]:
    """The answer (and plain decoding's, with --compare) from an engine loaded here, and where it ran."""
    engine = load_engine(args, [args.method])
    budget = args.max_new_tokens
    if budget is None:
        budget = answer_budget(
            len(engine.encode_prediction(prediction) or ()), len(engine.encode(messages)), engine.target.max_length
        )
    sampling = dict(
        max_new_tokens=budget, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    out = engine.generate(
        messages, method=args.method, gamma=args.gamma, prediction=prediction, **tree_kwargs(args), **sampling
    )
    reply = reply_of_generation(out)
    plain = None
    if args.compare:
        plain = reply_of_generation(engine.generate(messages, method="autoregressive", **sampling))
    return reply, plain, f"backend {out.stats.engine or engine.backend}"


def apply_command(args) -> int:
    """Exit status 0: the diff printed (nothing where the answer changes nothing) or the file written; 1: the answer
    held no usable code block (the file is left alone); 2 (SpecDecodeError): bad input."""
    from ..checks import check_request

    instruction = sys.stdin.read() if args.instruction == "-" else args.instruction
    if not instruction.strip():
        raise SpecDecodeError("the instruction is empty")
    source = read_source(args.file)
    check_request(
        method=args.method,
        gamma=args.gamma,
        max_new_tokens=1 if args.max_new_tokens is None else args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        **tree_kwargs(args),
    )
    messages, prediction = build_request(source, instruction)
    if args.server is None:
        reply, plain, where = run_local(args, messages, prediction)
    else:
        from .client import ask

        answer, plain_answer, where = ask(args, messages, prediction)
        reply, plain = reply_of(answer), None if plain_answer is None else reply_of(plain_answer)
    sys.stderr.write(stats_line(reply, plain, where, greedy=args.temperature == 0) + "\n")
    try:
        new = match_final_newline(extract_block(reply.text), source.text)
    except NoCodeBlock as e:
        ended = "the token limit (--max-new-tokens)" if reply.finish == "length" else "the model's end of text"
        sys.stderr.write(
            f"specdecode: error: {e}; the answer ended at {ended} after {len(reply.text)} characters, "
            f"beginning {reply.text[:160]!r}; {source.path} is unchanged\n"
        )
        return 1
    if new == source.text:
        sys.stderr.write(f"apply: the answer leaves {source.path} as it is\n")
    elif args.write:
        backup = write_atomically(source, new)
        sys.stderr.write(f"apply: wrote {source.path} (the old file: {backup})\n")
    else:
        sys.stdout.write(unified_diff(source.text, new, Path(os.path.normpath(source.path)).as_posix().lstrip("/")))
    return 0
