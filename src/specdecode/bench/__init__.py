"""`specdecode bench`: every method against plain decoding (and other tools' decoders) on a prompt file.

cli.py: the command and its arguments; run.py: the methods, the interleaved run; peers.py: the other tools'
decoders (llama.cpp, transformers' assisted generation; server_peer.py: llama-server's, launched as
launch/servers.py starts it; llama_peer_child.py: llama-cpp-python's process); summary.py: per-method totals,
speedups and bounds; report.py: results.json, report.md, speedup.png and acceptance.png. The prompt files and the
machine's lines are launch/'s, shared with `specdecode loadtest`. A new method needs nothing here (the method
table's flags say how it is summed up); a new peer is a name in peers.PEERS and its runner in run._run_one.

Its names load on first use (PEP 562): `specdecode bench`'s parser, built for every command, loads no torch.
"""

from ..lazy import lazy_names

# each public name and the module (in this package, or launch/) that defines it
_EXPORTS = {
    "load_prompts": "..launch.prompts",
    **dict.fromkeys(("BENCH_METHODS", "DRAFT_PEERS", "PEERS", "LlamaPeer", "has_flag", "hf_assisted"), ".peers"),
    **dict.fromkeys(("plot_acceptance", "plot_speedup", "report", "write_outputs"), ".report"),
    **dict.fromkeys(("check_methods", "default_methods", "needs_draft_model", "parse_methods", "run_bench"), ".run"),
    **dict.fromkeys(
        ("alpha_from_counts", "analytic_bound", "cost_model_bound", "decode_rate", "summarize"), ".summary"
    ),
}

__all__ = [
    "BENCH_METHODS",
    "DRAFT_PEERS",
    "PEERS",
    "LlamaPeer",
    "has_flag",
    "hf_assisted",
    "plot_acceptance",
    "plot_speedup",
    "report",
    "write_outputs",
    "check_methods",
    "default_methods",
    "load_prompts",
    "needs_draft_model",
    "parse_methods",
    "run_bench",
    "alpha_from_counts",
    "analytic_bound",
    "cost_model_bound",
    "decode_rate",
    "summarize",
]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
