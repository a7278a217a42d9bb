"""The memory a check may count on (host.memory_available): the smaller of the kernel's MemAvailable and what the
process's cgroups leave (v2 and v1, its own group and its ancestors'); and what loading a torch copy of a GGUF model
needs (backends.torch_copy_bytes): the first time, the conversion's peak."""

from __future__ import annotations

from pathlib import Path

from specdecode.host.machine import memory_available

GIB = 1 << 30


def fake_host(tmp_path: Path, meminfo_gib: float, self_cgroup: str) -> tuple[Path, Path]:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:  99999999 kB\nMemAvailable: {int(meminfo_gib * GIB) // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(self_cgroup)
    cgroup.mkdir()
    return proc, cgroup


def group(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)


def test_a_cgroup_v2_limit_below_meminfo_is_what_counts(tmp_path):
    proc, cgroup = fake_host(tmp_path, 8, "0::/box/app\n")
    (cgroup / "cgroup.controllers").write_text("cpu memory\n")
    group(cgroup / "box", {"memory.max": "max\n", "memory.current": str(3 * GIB)})
    group(
        cgroup / "box" / "app",
        {
            "memory.max": f"{2 * GIB}\n",
            "memory.current": f"{GIB}\n",
            "memory.stat": f"anon 1\ninactive_file {GIB // 4}\nactive_file 7\n",
        },
    )
    # the limit less what the group uses, its inactive page cache counted as free (as MemAvailable counts it)
    assert memory_available(proc, cgroup) == 2 * GIB - GIB + GIB // 4
    (cgroup / "box" / "memory.max").write_text(f"{GIB}\n")  # an ancestor's limit binds too
    assert memory_available(proc, cgroup) == 0


def test_a_cgroup_v1_limit_counts_and_no_limit_leaves_meminfo(tmp_path):
    proc, cgroup = fake_host(tmp_path, 8, "4:memory:/jobs/a\n3:cpu:/\n0::/\n")
    limited = {
        "memory.limit_in_bytes": str(3 * GIB),
        "memory.usage_in_bytes": str(GIB),
        "memory.stat": f"cache 5\ntotal_inactive_file {GIB}\n",
    }
    group(cgroup / "memory" / "jobs" / "a", limited)
    assert memory_available(proc, cgroup) == 3 * GIB
    # no limit: v1 writes 2**63 rounded down to a page; then the kernel's figure stands
    (cgroup / "memory" / "jobs" / "a" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_available(proc, cgroup) == 8 * GIB
    # a container's own namespace: /proc/self/cgroup says "/", the group is the mount itself
    (proc / "self" / "cgroup").write_text("4:memory:/\n")
    group(cgroup / "memory", {**limited, "memory.limit_in_bytes": str(GIB)})
    assert memory_available(proc, cgroup) == GIB


def test_without_cgroup_files_meminfo_stands_and_without_both_nothing_is_known(tmp_path):
    proc, cgroup = fake_host(tmp_path, 5, "0::/\n")
    assert memory_available(proc, cgroup) == 5 * GIB
    assert memory_available(tmp_path / "none", tmp_path / "none") is None


def test_loading_a_torch_copy_counts_the_conversion_once(tmp_path, monkeypatch):
    """bf16 weights are 2 bytes a parameter; the first load also holds the GGUF file and the dequantized tensors
    beside the model; once the converted copy is in the cache, only the weights."""
    from specdecode.backends import torch_copy_bytes
    from specdecode.backends.loading import converted_dir

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    n = 10_000
    assert torch_copy_bytes(gguf, n) == 1000 + 2 * 2 * n
    group(converted_dir(gguf, "bf16"), {"config.json": "{}"})
    assert torch_copy_bytes(gguf, n) == 2 * n


def test_route_leaves_torch_out_where_the_conversion_would_not_fit(tmp_path, monkeypatch):
    """--route's torch engine: the steady bf16 copy (2 GB) fits in 3 GB, the first load's conversion (file + 4 GB) does
    not, so torch stays out until the copy is converted."""
    from types import SimpleNamespace

    from specdecode import routing
    from specdecode.backends.loading import converted_dir

    monkeypatch.delenv("SPECDECODE_ROUTE_FORCE", raising=False)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    # this machine's matrix units must not decide the test
    monkeypatch.setattr(routing, "probed_flat_ratio", lambda engine, remeasure=False: 1.0)
    monkeypatch.setattr(routing, "memory_available", lambda: 3 * 10**9)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    engine = SimpleNamespace(target=SimpleNamespace(n_params=10**9, path=gguf))
    assert "loading the bf16 copy needs about" in routing.torch_unsuited(engine)
    group(converted_dir(gguf, "bf16"), {"config.json": "{}"})
    assert routing.torch_unsuited(engine) is None
