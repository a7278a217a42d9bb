"""The prompt files of `specdecode bench` and `specdecode loadtest`: JSONL, a prompt (completion) or chat turns per
line."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecDecodeError


def load_prompts(path: str | Path, limit: int | None = None, all_turns: bool = False) -> list[dict]:
    """JSONL rows with `prompt` (raw completion) or `turns` (chat: the first turn, or with all_turns
    every turn, as one conversation), optional `category` and `prediction` (the text the answer is expected to
    repeat: drafted from by our methods, as a server's client would send it)."""
    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"prompt file not found: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SpecDecodeError(f"{path}:{lineno}: expected a JSON object")
        if isinstance(obj.get("prompt"), str) and obj["prompt"]:
            row = {"prompt": obj["prompt"], "chat": False}
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            row = {"prompt": obj["turns"][0], "chat": True}
            if all_turns:
                if not all(isinstance(t, str) and t for t in obj["turns"]):
                    raise SpecDecodeError(f"{path}:{lineno}: every turn must be a non-empty string")
                row["turns"] = list(obj["turns"])
        else:
            raise SpecDecodeError(f"{path}:{lineno}: needs a non-empty 'prompt' string or a 'turns' list of strings")
        if obj.get("prediction") is not None:  # Predicted Outputs: the text the answer should mostly repeat
            if not isinstance(obj["prediction"], str):
                raise SpecDecodeError(f"{path}:{lineno}: 'prediction' must be a string")
            row["prediction"] = obj["prediction"]
        row["id"] = str(obj.get("task_id", obj.get("question_id", lineno)))
        row["category"] = obj.get("category") if isinstance(obj.get("category"), str) else None
        rows.append(row)
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise SpecDecodeError(f"{path}: no prompts")
    return rows
