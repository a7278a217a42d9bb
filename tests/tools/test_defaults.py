"""One set of defaults: the method and gamma a generation gets where none is named are the same in the Engine,
the request check, the app, Ray Serve's app, the command line, the method table and the docs."""

import inspect
import re
from pathlib import Path

from specdecode.checks import check_request
from specdecode.cli import build_parser
from specdecode.engine import Engine
from specdecode.methods import DEFAULT_GAMMA, DEFAULT_METHOD, METHOD_TABLE
from specdecode.server.app import create_app
from specdecode.server.ray_serve import ray_app

ROOT = Path(__file__).resolve().parents[2]


def _defaults(fn) -> tuple:
    parameters = inspect.signature(fn).parameters
    return parameters["method"].default, parameters["gamma"].default


def _parsed(*argv) -> tuple:
    args = build_parser().parse_args(list(argv))
    return args.method, args.gamma


def test_every_entry_point_defaults_to_the_method_tables_default():
    expected = (DEFAULT_METHOD, DEFAULT_GAMMA)
    assert _defaults(Engine.stream) == expected
    assert _defaults(check_request) == expected
    assert _defaults(create_app) == expected
    assert _defaults(ray_app) == expected
    assert _parsed("generate", "hi") == expected
    assert _parsed("serve") == expected


def test_the_table_and_the_docs_name_the_same_default():
    marked = [name for name, m in METHOD_TABLE.items() if "(default)" in m.summary]
    assert marked == [DEFAULT_METHOD]
    for page in ("README.md", "docs/guide/methods.md"):
        rows = re.findall(r"^\| `([a-z-]+)` \(default\) \|", (ROOT / page).read_text(), flags=re.M)
        assert rows == [DEFAULT_METHOD], page
    server = (ROOT / "docs/serving/server.md").read_text()
    assert f"method (`{DEFAULT_METHOD}` by default" in server
