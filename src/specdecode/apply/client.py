"""`specdecode apply --server URL`: the same request sent to a running `specdecode serve` through its OpenAI API
(/v1/chat/completions with `prediction`), read with the standard library alone (no model, no torch here)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from ..errors import SpecDecodeError

TIMEOUT_S = 3600.0  # a whole file's answer on a CPU can take minutes; the server ends what runs past its own limit
LOCAL_ONLY = ("target", "draft", "dtype", "device", "datastore", "draft_vocab", "draft_vocab_from", "threads")


def base_url(url: str) -> str:
    """The server's root, whether given as http://host:port, with a trailing slash or with /v1."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url.removesuffix("/v1")


def call(url: str, body: dict | None = None, key: str | None = None, timeout: float = TIMEOUT_S) -> dict:
    """GET (body None) or POST JSON; the answer's JSON. An error status is a SpecDecodeError with the server's
    message, an unreachable server one naming the address."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise SpecDecodeError(f"{url} answered {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SpecDecodeError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


def request_body(args, model: str, messages: list[dict], prediction: str | None, method: str) -> dict:
    """The chat request: the sampling arguments, max_tokens where given (else the server's: the room left in its
    context) and the speculation the command line asked for."""
    spec = {"method": method}
    if method != "autoregressive":
        spec.update(
            gamma=args.gamma,
            **{
                k: getattr(args, f"tree_{k}")
                for k in ("width", "depth", "nodes")
                if getattr(args, f"tree_{k}") is not None
            },
        )
    if args.exact:
        spec["exact"] = True
    body = {
        "model": model,
        "messages": messages,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "speculation": spec,
    }
    optional = {
        "max_tokens": args.max_new_tokens,
        "seed": args.seed,
        "top_k": args.top_k or None,
        "prediction": None if prediction is None else {"type": "content", "content": prediction},
    }
    return body | {k: v for k, v in optional.items() if v is not None}


def first_model(listing: dict, root: str) -> str:
    try:
        return listing["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise SpecDecodeError(f"{root}/v1/models lists no model; name one with --model") from None


def ask(args, messages: list[dict], prediction: str) -> tuple[dict, dict | None, str]:
    """The server's chat completion (and plain decoding's, with --compare), as JSON, and where it ran."""
    given = [f"--{name.replace('_', '-')}" for name in LOCAL_ONLY if getattr(args, name, None) is not None]
    if given or args.route:
        raise SpecDecodeError(
            f"{', '.join(given + ['--route'] * args.route)}: the server's models are its own; "
            "leave these out with --server"
        )
    root, key = base_url(args.server), args.api_key or os.environ.get("SPECDECODE_API_KEY")
    model = args.model or first_model(call(f"{root}/v1/models", key=key), root)
    chat = f"{root}/v1/chat/completions"
    answer = call(chat, request_body(args, model, messages, prediction, args.method), key)
    plain = call(chat, request_body(args, model, messages, None, "autoregressive"), key) if args.compare else None
    return answer, plain, f"server {root} (model {model})"
