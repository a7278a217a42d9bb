"""The server as Ray Serve replicas: a local Ray cluster on 127.0.0.1 with 2 replicas of the tiny models,
1 thread each, driven by the official openai client; and the `ray` extra kept optional. One module fixture starts
Ray once (35 s of the minute these tests take on 2 cores): the tests that need it are marked `cluster` (CI runs
them; `-m "not cluster"` leaves them out) and run on one xdist worker."""

import asyncio
import json
import socket
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import (
    http,  # the child-process runner (helpers.run drives the loop)
    run_child as run,
)
from specdecode.cli import main
from specdecode.server import ray_serve

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[2]


# -- without Ray -------------------------------------------------------------------------------------------------------
@pytest.mark.process
def test_ray_is_an_optional_extra():
    """The core install does not pull Ray, the test extra does (CI runs these tests), and neither importing
    specdecode nor its server imports it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.lower().startswith("ray") for d in project["dependencies"])
    assert any(d.startswith("ray[serve]>=") for d in project["optional-dependencies"]["ray"])
    assert "ray" in project["optional-dependencies"]["test"][0]  # specdecode[server,bench,ray]
    r = run(
        [
            sys.executable,
            "-c",
            "import sys, specdecode, specdecode.cli, specdecode.server; "
            "assert 'ray' not in sys.modules, 'ray imported'",
        ]
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.process
def test_serve_ray_without_ray_names_the_extra(tiny_dirs):
    target, _ = tiny_dirs
    code = f"""
import sys
sys.modules["ray"] = None  # as if not installed: importing it fails
from specdecode.cli import main
assert main(["serve", "--ray", "--replicas", "2", "--target", {str(target)!r}]) == 2
"""
    r = run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdecode: error:"), r.stderr
    assert 'pip install "specdecode[ray]"' in lines[0] and "serve --ray" in lines[0]


def test_ray_flags_are_checked(capsys):
    assert main(["serve", "--replicas", "2"]) == 2  # without --ray
    assert main(["serve", "--ray", "--replicas", "2", "--autoscale", "1,2"]) == 2  # both
    assert capsys.readouterr().err.count("specdecode: error: --replicas and --autoscale go with --ray") == 2
    # serve's own settings, checked by the same function before Ray starts
    for args, match in (
        (["--max-queue", "0"], "--max-queue must be a positive integer"),
        (["--gamma", "0"], "--gamma must be"),
        (["--parallel", "2"], "--parallel is not available inside Ray replicas"),
    ):
        assert main(["serve", "--ray", *args]) == 2
        assert match in capsys.readouterr().err
    with pytest.raises(ray_serve.SpecDecodeError, match="MIN,MAX"):
        ray_serve.parse_autoscale("2")
    for bad in ((0, 0), (3, 2), (-1, 2)):
        with pytest.raises(ray_serve.SpecDecodeError, match="autoscale"):
            ray_serve._scaling(1, bad, 2.0)
    assert ray_serve._scaling(3, None, 2.0) == {"num_replicas": 3}
    auto = ray_serve._scaling(1, (1, 4), 2.0)["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 2.0)


def test_serve_ray_that_cannot_start_exits_with_one_line(tiny_dirs, monkeypatch, capsys):
    """Serve's proxy that fails its readiness check (a busy machine): tried again, with longer readiness timeouts
    in the controller's environment, then one clear line and exit status 2, not Ray's traceback."""
    ray = pytest.importorskip("ray")
    from ray import serve

    calls = []

    def failing_start(**kwargs):
        calls.append(kwargs)
        raise RuntimeError(
            "ActorDiedError: The actor died unexpectedly before finishing this task.\n\tclass_name: "
            "ProxyActor\n(the proxy failed its readiness check 3 times)"
        )

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no cluster: start goes straight to serve.start
    monkeypatch.setattr(serve, "start", failing_start)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    target, _ = tiny_dirs
    assert main(["serve", "--ray", "--target", str(target), "--method", "pld", "--port", "8765"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("specdecode: error: Ray Serve did not start") and "Traceback" not in "".join(lines)
    assert "ActorDiedError" in lines[-1] and "8765" in lines[-1]
    assert len(calls) == ray_serve.START_TRIES >= 2
    env = calls[0]["controller_options"]["runtime_env"]["env_vars"]
    assert float(env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) >= 30  # Ray's default: 5 s
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == ray_serve.PROXY_CALLBACK


@pytest.mark.parametrize(
    "connected, started_here",
    [(True, False), (False, False), (False, True)],
    ids=["connected-before", "attached", "started-here"],
)
def test_a_failed_start_shuts_serve_down_only_on_a_cluster_started_here(monkeypatch, connected, started_here):
    """serve.shutdown() stops every Serve application of the cluster: after a failed start it runs only where this
    process started the cluster itself, never where it attached to one ($RAY_ADDRESS, a `ray start`)."""
    ray = pytest.importorskip("ray")
    from types import SimpleNamespace

    from ray import serve

    state = {"initialized": connected}
    shutdowns = []

    def init(**kwargs):
        state["initialized"] = True
        monkeypatch.setattr(ray._private.worker, "_global_node", SimpleNamespace(head=started_here))

    def failing_start(**kwargs):
        raise RuntimeError("ActorDiedError: the proxy failed its readiness check")

    monkeypatch.setattr(ray._private.worker, "_global_node", SimpleNamespace(head=False) if connected else None)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: state.update(initialized=False))
    monkeypatch.setattr(serve, "start", failing_start)
    monkeypatch.setattr(serve, "shutdown", lambda: shutdowns.append(1))
    with pytest.raises(ray_serve.SpecDecodeError, match="did not start"):
        ray_serve.start("127.0.0.1", 8765)
    assert len(shutdowns) == (ray_serve.START_TRIES if started_here else 0)
    assert state["initialized"] == connected  # a connection this call made is closed; one it found is kept


def test_replica_is_ready_only_after_load_and_cost_measurement(tiny_dirs):
    """The replica's constructor (what Ray Serve waits for before it routes to it) loads the models and measures
    the pass costs; its app carries the replica id in a header and in every metric sample."""
    from fastapi.testclient import TestClient

    target, draft = tiny_dirs
    replica = ray_serve.Replica(
        dict(target=str(target), draft=str(draft), backend="torch", threads=1),
        dict(model_id=MODEL, method="draft"),
        ctx_size=128,
    )
    app = replica.__serve_build_asgi_app__()
    assert app.state.engine.costs is not None  # measured in the constructor, not in the first request
    assert app.state.engine.target.max_length == 128  # --ctx-size, applied after measuring
    with TestClient(app) as c:
        replica.check_health()
        r = c.post("/v1/completions", json=dict(model=MODEL, prompt="ab", max_tokens=4))
        assert r.status_code == 200 and r.headers[ray_serve.REPLICA_HEADER] == replica.replica_id
        samples = [s for f in text_string_to_metric_families(c.get("/metrics").text) for s in f.samples]
    assert samples and all(s.labels["replica"] == replica.replica_id for s in samples)


def test_proxy_finishes_what_a_dead_replica_left():
    """Ray's proxy ends a response silently when its replica dies; ReplicaFault (in the proxy) makes that a 503
    with Retry-After before anything was sent, and an error event plus [DONE] in a stream that had begun."""

    async def call(inner):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.disconnect"}

        await ray_serve.ReplicaFault(inner)({"type": "http", "path": "/v1/completions"}, receive, send)
        return sent

    async def died_before(scope, receive, send):
        return None

    async def died_in_stream(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    async def finished(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent = asyncio.run(call(died_before))
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "replica_unavailable"
    sent = asyncio.run(call(died_in_stream))
    tail = sent[-1]["body"].decode()
    assert not sent[-1]["more_body"] and tail.endswith("data: [DONE]\n\n")
    assert json.loads(tail.split("\n\n")[0].removeprefix("data: "))["error"]["type"] == "server_error"
    assert len(asyncio.run(call(finished))) == 2  # a finished response is left alone


# -- a local Ray cluster -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tiny_dirs, tmp_path_factory):
    """2 replicas x 1 thread of the tiny pair behind Ray Serve's proxy on 127.0.0.1, and the same app in process."""
    ray = pytest.importorskip("ray", reason='Ray Serve is not installed (pip install -e ".[ray]"; CI installs it)')
    from ray import serve

    target, draft = tiny_dirs
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cache = tmp_path_factory.mktemp("ray-cache")
    start = time.monotonic()
    ray_serve.start(
        "127.0.0.1",
        port,
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        log_to_driver=False,
        runtime_env={"env_vars": {"SPECDECODE_CACHE": str(cache)}},
    )
    try:
        app = ray_serve.ray_app(
            str(target),
            str(draft),
            method="draft",
            gamma=3,
            replicas=2,
            threads=1,
            backend="torch",
            served_model_name=MODEL,
            timeout_s=60,
        )
        serve.run(app, name=ray_serve.APP_NAME, route_prefix="/")
        sys.stderr.write(f"ray cluster and 2 replicas ready in {time.monotonic() - start:.1f} s\n")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            mp.undo()


@pytest.fixture(scope="module")
def plain(tiny_dirs):
    """`specdecode serve` without Ray: the same app in this process, for reference answers."""
    from fastapi.testclient import TestClient

    from specdecode import Engine
    from specdecode.server import create_app

    target, draft = tiny_dirs
    engine = Engine.load(str(target), str(draft), backend="torch", threads=1, progress=False)
    with TestClient(create_app(engine, model_id=MODEL, method="draft", gamma=3)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def client(url: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def answers(c: openai.OpenAI) -> dict:
    messages = [{"role": "user", "content": "hi there"}]
    out = {
        "completion": c.completions.create(model=MODEL, prompt="hello world", max_tokens=24, temperature=0)
        .choices[0]
        .text,
        "chat": c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        .choices[0]
        .message.content,
    }
    out["completion stream"] = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt="hello world", max_tokens=24, temperature=0, stream=True)
    )
    out["chat stream"] = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
        if ch.choices
    )
    return out


@pytest.mark.cluster
@pytest.mark.xdist_group("ray")
def test_answers_through_ray_equal_plain_serve(cluster, plain):
    through_ray, reference = answers(client(cluster)), answers(plain)
    assert through_ray == reference
    assert reference["completion"] == reference["completion stream"] and reference["completion"]
    assert [m.id for m in client(cluster).models.list().data] == [MODEL]


@pytest.mark.cluster
@pytest.mark.xdist_group("ray")
def test_requests_spread_over_both_replicas_with_their_metrics(cluster):
    c = client(cluster)

    def one(i):
        r = c.completions.with_raw_response.create(model=MODEL, prompt=f"spread {i}", max_tokens=8, temperature=0)
        return r.headers[ray_serve.REPLICA_HEADER], r.parse().choices[0].text

    with ThreadPoolExecutor(4) as pool:
        replicas = {rid for rid, _ in pool.map(one, range(12))}
    assert len(replicas) == 2, replicas
    seen = {}
    for _ in range(20):  # a scrape goes to one replica: each labels its own samples
        r = http.get(f"{cluster}/metrics", timeout=10)
        rid = r.headers[ray_serve.REPLICA_HEADER]
        labels = {s.labels.get("replica") for f in text_string_to_metric_families(r.text) for s in f.samples}
        assert labels == {rid}
        seen[rid] = r.text
        if len(seen) == 2:
            break
    assert set(seen) == replicas
    assert http.get(f"{cluster}/health", timeout=10).json()["model"] == MODEL


@pytest.mark.cluster
@pytest.mark.xdist_group("ray")
def test_replica_killed_mid_stream_fails_cleanly_and_is_replaced(cluster):
    import ray

    c = client(cluster, timeout=30)
    with c.completions.with_streaming_response.create(
        model=MODEL,
        prompt="a",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"speculation": {"method": "autoregressive"}},
    ) as response:
        rid = response.headers[ray_serve.REPLICA_HEADER]
        stream = iter(response.parse())
        text = next(stream).choices[0].text
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{ray_serve.APP_NAME}#SpecDecode#{rid}", namespace="serve"))
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="replica") as failure:
            for chunk in stream:
                text += chunk.choices[0].text
                assert chunk.choices[0].finish_reason is None, "the stream ended as if complete"
        assert time.monotonic() - t0 < 20
    assert failure.value.body["code"] == "replica_unavailable"

    def one(i):
        r = c.completions.with_raw_response.create(model=MODEL, prompt=f"after {i}", max_tokens=6, temperature=0)
        return r.headers[ray_serve.REPLICA_HEADER]

    assert rid not in {one(i) for i in range(4)}  # the next requests succeed, on the replica left
    deadline = time.monotonic() + 90
    with ThreadPoolExecutor(4) as pool:
        while True:  # Ray Serve starts a replacement: requests reach two replicas again, neither the dead one
            seen = set(pool.map(one, range(8)))
            assert rid not in seen
            if len(seen) == 2:
                break
            assert time.monotonic() < deadline, "no replacement replica within 90 s"
            time.sleep(1)
