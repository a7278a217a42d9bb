"""Token ids of a handful of requests on the tiny test models (tests/tiny.py), through the Engine, a Router and the
HTTP server: every method, with and without a prediction, greedy and one seeded sample. Run it on two codes and
compare the files, to show that a change kept the outputs:

    python scripts/same_outputs.py OUT.json                       (this checkout)
    PYTHONPATH=<worktree>/src python scripts/same_outputs.py OLD.json   (the code before)
    cmp OUT.json OLD.json

The pass costs are fixed (tests/helpers.py's CHEAP), so that the planned methods choose the same shapes on any
machine; auto still learns the draft model's rate from its measured steps.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from helpers import CHEAP  # noqa: E402
from tiny import build_engine, char_tokenizer  # noqa: E402

OLD = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    ("def fib(n):\n", False, None),
    ("Rename add to plus:\n" + OLD, False, OLD),
    ([{"role": "user", "content": "Rename add to plus:\n" + OLD}], True, OLD.replace("add", "plus")),
    ("the cat sat on the mat. the cat sat on the", False, None),
]
METHODS = ("autoregressive", "auto", "draft", "pld", "lookup", "tree")
N = 40


def engine_outputs() -> dict:
    engine = build_engine(0, 1, char_tokenizer(), costs=CHEAP, progress=False)
    out = {}
    for method in METHODS:
        for i, (prompt, chat, prediction) in enumerate(PROMPTS):
            g = engine.generate(prompt, chat=chat, method=method, max_new_tokens=N, prediction=prediction)
            out[f"engine/{method}/{i}"] = [
                g.token_ids,
                g.stats.accepted_prediction_tokens,
                g.stats.rejected_prediction_tokens,
            ]
        g = engine.generate(
            PROMPTS[1][0], method=method, max_new_tokens=N, temperature=0.8, seed=1, prediction=PROMPTS[1][2]
        )
        out[f"engine/{method}/sampled"] = g.token_ids
    out["engine/tree/shaped"] = engine.generate(
        PROMPTS[1][0], method="tree", tree_width=2, tree_depth=3, max_new_tokens=N, prediction=OLD
    ).token_ids
    out["engine/draft/gamma2"] = engine.generate(PROMPTS[0][0], method="draft", gamma=2, max_new_tokens=N).token_ids
    out["engine/stop"] = engine.generate(PROMPTS[3][0], method="pld", max_new_tokens=N, stop=["mat"]).token_ids
    return out


def router_outputs() -> dict:
    from specdecode.routing import Router

    router = Router({"torch": build_engine(0, 1, char_tokenizer(), costs=CHEAP, progress=False)})
    return {
        f"router/{method}": router.generate(PROMPTS[1][0], method=method, max_new_tokens=N, prediction=OLD).token_ids
        for method in ("auto", "pld")
    }


def server_outputs() -> dict:
    from fastapi.testclient import TestClient

    from specdecode.server import create_app

    engine = build_engine(0, 1, char_tokenizer(), costs=CHEAP, progress=False)
    out = {}
    with TestClient(create_app(engine, model_id="tiny", method="auto")) as client:
        for method in ("auto", "pld", "tree", "draft"):
            for i, (prompt, chat, prediction) in enumerate(PROMPTS[:3]):
                body = {"model": "tiny", "max_tokens": N, "temperature": 0, "speculation": {"method": method}}
                if prediction is not None:
                    body["prediction"] = {"type": "content", "content": prediction}
                if chat:
                    r = client.post("/v1/chat/completions", json={**body, "messages": prompt}).json()
                    out[f"server/{method}/{i}"] = [r["choices"][0]["message"]["content"], r["usage"]]
                else:
                    r = client.post("/v1/completions", json={**body, "prompt": prompt}).json()
                    out[f"server/{method}/{i}"] = [r["choices"][0]["text"], r["usage"]]
    return out


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    out = {**engine_outputs(), **router_outputs(), **server_outputs()}
    Path(out_path).write_text("".join(f"{k} {json.dumps(v)}\n" for k, v in sorted(out.items())))
    print(f"{len(out)} outputs written to {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
