"""The traffic of `specdecode loadtest --soak`: what each client sends, and the record of what came back.

Kinds of request (each record has `kind` and `variant`):
- honest: chat or completions, greedy or sampled (seeded), streamed or not, with or without stop strings and
  `max_tokens`, some with an OpenAI `prediction` (the last answer to the same request, else its prompt);
- disconnect: a client that leaves while its request waits in the queue (right after the headers), during the
  prompt's read (a long prompt, left after a short random delay) or during decoding (after a few text chunks),
  or a non-streamed request given up after a random delay;
- deadline: a greedy chat without `max_tokens` on a long prompt, which may run past the server's `--timeout`
  (then it ends with finish_reason "length" and `speculation.finish_reason` "timeout", or a 503 `timeout`);
- oversized: a body past the server's 8 MiB limit (413), or a prompt far past the model's context (400);
- malformed: broken JSON, wrong types, unknown models and fields, a lone surrogate, bad roles (4xx).

Every request goes through `client.one_request` (the load benchmark's client) where it is JSON, or a plain POST of
raw bytes where it is not; a refused connection (the server restarting) is marked `refused`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from .client import one_request

KIND_WEIGHTS = {"honest": 0.6, "disconnect": 0.16, "deadline": 0.04, "oversized": 0.04, "malformed": 0.16}
OVERSIZED_BYTES = (8 << 20) + (1 << 20)  # past the server's 8 MiB body limit (server.app.MAX_BODY_BYTES)
STOPS = ["\n\n", ["\n", "return"], ".", ["}", ")"]]
FILLER = "The quick brown fox jumps over the lazy dog while the compiler checks every branch of the program. "
PROMPTS = [
    {"id": "fib", "prompt": "def fibonacci(n):", "chat": False},
    {"id": "sort", "prompt": "Write a Python function that sorts a list of dictionaries by a key.", "chat": True},
    {"id": "json", "prompt": "import json\n\ndef load_config(path):", "chat": False},
    {"id": "explain", "prompt": "Explain what a context manager is in Python, with an example.", "chat": True},
    {"id": "sql", "prompt": "-- SQL: the ten customers with the highest total order value\nSELECT", "chat": False},
    {"id": "regex", "prompt": "Write a regular expression that matches an IPv4 address, and test it.", "chat": True},
]


def malformed_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(variant, path, raw body) of requests a server must refuse with a 4xx."""

    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    c, chat = "/v1/completions", "/v1/chat/completions"
    return [
        ("truncated-json", c, b'{"model": "' + model.encode() + b'", "prompt": "def f('),
        ("not-an-object", c, b"[1, 2, 3]"),
        ("not-json", chat, b"hello there"),
        ("invalid-utf8", c, b'{"model": "x", "prompt": "\xff\xfe\xfd"}'),
        ("prompt-not-text", c, js({"model": model, "prompt": 123})),
        ("no-prompt", c, js({"model": model})),
        ("unknown-model", c, js({"model": model + "-nope", "prompt": "x"})),
        ("no-messages", chat, js({"model": model, "messages": []})),
        ("bad-role", chat, js({"model": model, "messages": [{"role": "wizard", "content": "x"}]})),
        (
            "lone-surrogate",
            chat,
            ('{"model": %s, "messages": [{"role": "user", "content": "a\\ud800b"}]}' % json.dumps(model)).encode(),
        ),
        ("negative-max-tokens", c, js({"model": model, "prompt": "x", "max_tokens": -1})),
        ("n-3", c, js({"model": model, "prompt": "x", "n": 3})),
        ("logprobs", c, js({"model": model, "prompt": "x", "logprobs": 5})),
        ("temperature-text", c, js({"model": model, "prompt": "x", "temperature": "hot"})),
        ("stream-text", chat, js({"model": model, "messages": [{"role": "user", "content": "x"}], "stream": "yes"})),
        ("bad-prediction", c, js({"model": model, "prompt": "x", "prediction": {"type": "content", "content": 5}})),
    ]


def long_prompt(row: dict, chars: int) -> str:
    return (FILLER * (chars // len(FILLER) + 1))[:chars] + "\n\n" + row["prompt"]


def honest_body(
    rng: random.Random, row: dict, model: str, max_tokens: int, answers: dict, stream: bool | None = None
) -> tuple[str, dict]:
    """An honest request on `row` (variant, body); answers: the last text per request (for `prediction`)."""
    chat = row.get("chat", False) if rng.random() < 0.7 else not row.get("chat", False)
    body: dict = {"model": model}
    if chat:
        body["messages"] = [{"role": "user", "content": row["prompt"]}]
    else:
        body["prompt"] = row["prompt"]
    greedy = rng.random() < 0.6
    body["temperature"] = 0.0 if greedy else rng.choice([0.7, 1.0])
    if not greedy:
        body.update(seed=rng.randrange(1 << 31), top_p=rng.choice([1.0, 0.9]))
    body["stream"] = rng.random() < 0.6 if stream is None else stream
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS)
    if rng.random() < 0.75:
        body["max_tokens"] = rng.randint(1, max_tokens)
    elif chat:  # without max_tokens a chat may run to the context: bounded here by the prompt asking for little
        body["messages"][0]["content"] += " Answer in two sentences."
    if rng.random() < 0.2:
        body["prediction"] = {"type": "content", "content": answers.get(request_key(body)) or row["prompt"]}
    variant = "/".join(
        [
            ("chat" if chat else "completions"),
            ("greedy" if greedy else "sampled"),
            ("stream" if body["stream"] else "json"),
        ]
        + (["stop"] if "stop" in body else [])
        + (["max_tokens"] if "max_tokens" in body else [])
        + (["prediction"] if "prediction" in body else [])
    )
    return variant, body


def request_key(body: dict) -> str:
    """The request without what only shapes its delivery (its prediction, streaming): what its answer depends on."""
    return json.dumps(
        {k: v for k, v in body.items() if k not in ("prediction", "stream", "stream_options")}, sort_keys=True
    )


class Traffic:
    """The mix of requests one soak sends: `next()` draws a kind and sends one request of it, returning its
    record. `state["generation"]`: which server process is serving (0 before the restart, 1 after)."""

    def __init__(
        self,
        client,
        url: str,
        model: str,
        *,
        seed: int,
        prompts: list[dict],
        max_tokens: int,
        long_chars: int,
        too_long_chars: int,
        state: dict,
        weights: dict | None = None,
    ):
        self.client, self.url, self.model = client, url, model
        self.rng = random.Random(seed)
        self.prompts, self.max_tokens = prompts, max_tokens
        self.long_chars, self.too_long_chars = long_chars, too_long_chars
        self.state, self.answers = state, {}
        self.weights = weights or KIND_WEIGHTS
        unknown = sorted(set(self.weights) - set(self.KINDS))
        if unknown:
            raise ValueError(f"unknown kind(s) of request {', '.join(unknown)}; known: {', '.join(self.KINDS)}")
        self.malformed = malformed_bodies(model)
        self.sent = 0

    async def next(self, kind: str | None = None) -> dict:
        kind = kind or self.rng.choices(list(self.weights), list(self.weights.values()))[0]
        send = self.KINDS.get(kind)
        if send is None:
            raise ValueError(f"unknown kind of request {kind!r}; known: {', '.join(self.KINDS)}")
        self.sent += 1
        i, generation = self.sent, self.state.get("generation", 0)
        t0 = time.perf_counter()
        rec = await send(self)
        rec.update(i=i, kind=kind, generation=generation, t_start=t0, t_end=time.perf_counter())
        rec["refused"] = (
            rec.get("status") is None and rec.get("error") is not None and rec["error"].startswith("ConnectError")
        )
        return rec

    async def _send(self, body: dict, variant: str, hang_up=None, give_up_s: float | None = None) -> dict:
        row = {"id": variant}
        call = one_request(self.client, self.url, self.model, row, 0, body=body, hang_up=hang_up)
        if give_up_s is None:
            rec = await call
        else:
            try:
                rec = await asyncio.wait_for(call, give_up_s)
            except asyncio.TimeoutError:
                rec = {"id": variant, "status": None, "error": None, "hung_up": True, "text": ""}
        rec["variant"], rec["stream"] = variant, bool(body.get("stream"))
        return rec

    async def _honest(self) -> dict:
        variant, body = honest_body(self.rng, self.rng.choice(self.prompts), self.model, self.max_tokens, self.answers)
        rec = await self._send(body, variant)
        if rec.get("status") == 200 and rec.get("error") is None and not rec.get("hung_up"):
            self.answers[request_key(body)] = rec["text"]
        if body["temperature"] == 0.0:
            rec["body"] = body  # re-sent alone at the end: the same answer is due
        return rec

    async def _disconnect(self) -> dict:
        row = self.rng.choice(self.prompts)
        phase = self.rng.choice(["queue", "prefill", "decode", "json"])
        body = {
            "model": self.model,
            "prompt": row["prompt"],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": phase != "json",
        }
        if phase == "prefill":
            body["prompt"] = long_prompt(row, self.long_chars)
            return await self._send(body, "disconnect/prefill", give_up_s=self.rng.uniform(0.02, 0.5))
        if phase == "json":
            return await self._send(body, "disconnect/json", give_up_s=self.rng.uniform(0.02, 1.5))
        if phase == "queue":
            return await self._send(body, "disconnect/queue", hang_up=lambda rec: True)
        after = self.rng.randint(1, 6)
        return await self._send(body, "disconnect/decode", hang_up=lambda rec: len(rec["text"]) >= after)

    async def _deadline(self) -> dict:
        row = self.rng.choice(self.prompts)
        body = {
            "model": self.model,
            "temperature": 0.0,
            "stream": self.rng.random() < 0.5,
            "messages": [
                {
                    "role": "user",
                    "content": long_prompt(row, self.long_chars // 2)
                    + "\nWrite a long, detailed answer with many examples.",
                }
            ],
        }
        return await self._send(body, "deadline/" + ("stream" if body["stream"] else "json"))

    async def _oversized(self) -> dict:
        if self.rng.random() < 0.5:
            raw = b'{"model": "%s", "prompt": "' % self.model.encode() + b"x" * OVERSIZED_BYTES + b'"}'
            return await self._raw("oversized/body", "/v1/completions", raw)
        body = {"model": self.model, "prompt": "word " * (self.too_long_chars // 5), "max_tokens": 4}
        return await self._send(body, "oversized/prompt")

    async def _malformed(self) -> dict:
        variant, path, raw = self.rng.choice(self.malformed)
        return await self._raw("malformed/" + variant, path, raw)

    # each kind of request (the module's docstring) and the method that sends one
    KINDS = {
        "honest": _honest,
        "disconnect": _disconnect,
        "deadline": _deadline,
        "oversized": _oversized,
        "malformed": _malformed,
    }

    async def _raw(self, variant: str, path: str, raw: bytes) -> dict:
        rec = {
            "id": variant,
            "variant": variant,
            "status": None,
            "error": None,
            "text": "",
            "hung_up": False,
            "stream": False,
        }
        try:
            r = await self.client.post(self.url + path, content=raw, headers={"content-type": "application/json"})
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
        except Exception as e:  # noqa: BLE001 - a transport failure is a result here
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return rec
