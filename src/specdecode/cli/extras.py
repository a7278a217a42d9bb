"""The check that a command's optional packages are installed, before it imports them."""

from __future__ import annotations

import importlib.util

from ..errors import SpecDecodeError

# what `specdecode serve` and `specdecode bench` import beyond the core, and the extra that installs it
EXTRAS = {
    "serve": ("server", ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "anyio")),
    "bench": ("bench", ("matplotlib",)),
    "serve --ray": ("ray", ("ray",)),
}


def require_extra(command: str) -> None:
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecDecodeError(
            f"`specdecode {command}` needs {', '.join(missing)}, which is not installed: "
            f'pip install "specdecode[{extra}]" (from a checkout: pip install -e ".[{extra}]")'
        )
