"""The server answers an error by its class (errors.py), never by its message: every error class declares a status,
an OpenAI type and code that the response carries, and every `raise` in the server raises one of them (or one of the
few exceptions that never become a response, listed here with the reason)."""

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest

from specdecode import errors
from specdecode.errors import ContextExceeded, EngineUnavailable, InvalidField, SpecDecodeError
from specdecode.server import protocol as p
from specdecode.server.scheduler import generation_error
from specdecode.server.service import error_response

SRC = Path(errors.__file__).parent
SERVER = SRC / "server"
ERROR_CLASSES = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, SpecDecodeError)]

# exceptions a server module raises that never become an HTTP answer
NOT_ANSWERS = {
    "Disconnected": "the client is gone: nobody to answer",
    "KeyboardInterrupt": "serve --ray stops on a signal",
    "AssertionError": "a broken invariant inside the server",
    "RuntimeError": "a Ray replica's failed health check, read by Ray Serve",
}


def _raised_classes():
    """(module, line, what it raises, the raise's expression) for every `raise X` / `raise f(...)` in the server."""
    for path in sorted(SERVER.glob("*.py")):
        module = importlib.import_module(f"specdecode.server.{path.stem}")
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id not in vars(module):  # raise refused; refused = p.unsupported(...)
                home = min(
                    (f for f in functions if f.lineno <= node.lineno <= f.end_lineno),
                    key=lambda f: f.end_lineno - f.lineno,
                )
                assigned = [
                    a.value
                    for a in ast.walk(home)
                    if isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == exc.id for t in a.targets)
                ]
                exc = assigned[0].func if assigned and isinstance(assigned[0], ast.Call) else exc
            yield path.name, node.lineno, _resolve(module, exc), node.exc


def _resolve(module, node):
    if isinstance(node, ast.Name):
        return vars(module).get(
            node.id,
            getattr(__builtins__, node.id, None) if not isinstance(__builtins__, dict) else __builtins__.get(node.id),
        )
    if isinstance(node, ast.Attribute):
        owner = _resolve(module, node.value)
        return getattr(owner, node.attr, None)
    return None


def _error_class(obj):
    """The SpecDecodeError class that raising `obj` raises: the class itself, or the one a function returns."""
    if isinstance(obj, type):
        return obj if issubclass(obj, SpecDecodeError) else None
    if callable(obj):
        returns = inspect.signature(obj, eval_str=True).return_annotation
        kinds = [k for k in typing.get_args(returns) or (returns,) if k is not type(None)]  # X | None: X
        return kinds[0] if len(kinds) == 1 and _error_class(kinds[0]) else None
    return None


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=[c.__name__ for c in ERROR_CLASSES])
def test_every_error_class_declares_its_answer_and_the_response_carries_it(cls):
    assert isinstance(cls.status, int) and 400 <= cls.status < 600
    assert cls.type == ("invalid_request_error" if cls.status < 500 else "server_error")
    assert isinstance(cls.code, str) and cls.code
    for words in ("one message", "quite another message, reworded"):
        r = error_response(cls(words))
        body = r.body.decode()
        assert r.status_code == cls.status and p.ErrorBody.model_validate_json(body).error.code == cls.code
        assert p.ErrorBody.model_validate_json(body).error.type == cls.type


def test_every_raise_in_the_server_is_a_typed_error():
    untyped = []
    for name, line, obj, node in _raised_classes():
        if _error_class(obj) is not None or getattr(obj, "__name__", None) in NOT_ANSWERS:
            continue
        if getattr(obj, "__name__", None) == "HTTPException":  # Starlette's own: its status must be a typed error's
            status = node.args[0]
            if isinstance(status, ast.Attribute) and status.attr == "status":
                owner = _resolve(importlib.import_module(f"specdecode.server.{name[:-3]}"), status.value)
                if _error_class(owner) is not None:
                    continue
        untyped.append(f"{name}:{line}: raise {ast.unparse(node)}")
    assert not untyped, "raise a typed error (errors.py) instead:\n" + "\n".join(untyped)


def test_the_walk_finds_the_raises_it_checks():
    """The check above reads real raise sites: the ones it must know about are among them."""
    found = {(name, getattr(obj, "__name__", None)) for name, _, obj, _ in _raised_classes()}
    assert {
        ("service.py", "ModelNotFound"),
        ("service.py", "ContextExceeded"),
        ("app.py", "Unauthorized"),
        ("app.py", "HTTPException"),
        ("service.py", "unsupported"),
    } <= found


@pytest.mark.parametrize(
    "error, status, code",
    [
        (EngineUnavailable("llama_decode failed"), 503, "engine_unavailable"),
        (EngineUnavailable("the prompt has 9 tokens; the model's context holds 8"), 503, "engine_unavailable"),
        (ContextExceeded("llama_decode failed", param="prompt"), 400, "context_length_exceeded"),
        (SpecDecodeError("the prompt has 9 tokens; the model's context holds 8"), 500, "engine_error"),
    ],
)
def test_a_running_generations_error_is_answered_by_its_class_whatever_its_words(error, status, code):
    err = generation_error(error, "completions", retry_after=7)
    assert (err.status, err.code) == (status, code)
    assert (err.headers() or {}).get("Retry-After") == ("7" if status == 503 else None)


def test_an_engine_fields_name_is_the_requests():
    for engine_name, wire in (
        ("gamma", "speculation.gamma"),
        ("max_new_tokens", "max_tokens"),
        ("prompt", "messages"),
        ("temperature", "temperature"),
    ):
        err = p.engine_error(InvalidField("words that name no field", param=engine_name), "messages")
        assert err.param == wire and err.code == "invalid_value"


def test_every_engine_param_has_a_request_field():
    """A field the Engine names (`param="..."` at a raise site) is one a request has, under its own name or
    through protocol.WIRE_FIELDS."""
    request_fields = set(p.request_models(8)[1].model_fields) | set(p.request_models(8)[0].model_fields)
    named = set()
    for path in SRC.rglob("*.py"):
        if "server" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                named |= {
                    k.value.value
                    for k in node.keywords
                    if k.arg == "param" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)
                }
    assert {"prompt", "temperature", "exact", "method"} <= named  # the walk sees the Engine's raise sites
    assert not {n for n in named if n not in p.WIRE_FIELDS and n not in request_fields}
