"""`specdecode bench`: every method against plain decoding (and other tools' decoders) on a prompt file.

run.py: the prompts, the methods, the interleaved run; peers.py: the other tools' decoders (llama.cpp,
transformers' assisted generation); summary.py: per-method totals, speedups and bounds; report.py:
results.json, report.md, speedup.png and acceptance.png. A new method needs nothing here (the method
table's flags say how it is summed up); a new peer is a name in peers.PEERS and its runner in run._run_one.
"""
from .peers import BENCH_METHODS, DRAFT_PEERS, PEERS, LlamaPeer, _is, hf_assisted
from .report import plot_acceptance, plot_speedup, report, write_outputs
from .run import (check_methods, cpu_description, default_methods, load_prompts, needs_draft_model, parse_methods,
                  run_bench)
from .summary import alpha_from_counts, analytic_bound, cost_model_bound, decode_rate, summarize

__all__ = ["BENCH_METHODS", "DRAFT_PEERS", "PEERS", "LlamaPeer", "hf_assisted", "plot_acceptance", "plot_speedup",
           "report", "write_outputs", "check_methods", "cpu_description", "default_methods", "load_prompts",
           "needs_draft_model", "parse_methods", "run_bench", "alpha_from_counts", "analytic_bound",
           "cost_model_bound", "decode_rate", "summarize"]
