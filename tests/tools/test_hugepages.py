"""Huge pages for the weights (hugepages.py): when `specdecode` restarts itself with glibc's THP tunable, that
peers get the user's environment back, and, on a machine where it applies, that the restarted process really
holds huge pages. Also the command's heavy imports with the collector paused (imports.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

from specdecode.host import hugepages
from specdecode.launch.servers import Launched


@pytest.fixture
def madvise_glibc(monkeypatch):
    monkeypatch.setattr(hugepages, "_thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages, "_glibc_has_tunable", lambda: True)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")


def test_restart_adds_the_tunable_and_remembers_the_users(madvise_glibc):
    argv, env = hugepages.restart_argv({"PATH": "/bin"})
    assert argv[0] == sys.executable and argv[1:] == sys.orig_argv[1:]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env[hugepages.BEFORE] == "" and env["PATH"] == "/bin"
    _, env = hugepages.restart_argv({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env[hugepages.BEFORE] == "glibc.malloc.arena_max=2"


@pytest.mark.parametrize(
    "environ", [{"SPECDECODE_HUGEPAGES": "0"}, {hugepages.BEFORE: ""}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}]
)
def test_no_restart_when_off_or_done(madvise_glibc, environ):
    assert hugepages.restart_argv(environ) is None  # no loop, and a user's own choice is kept


@pytest.mark.parametrize("mode", ["always", "never", None])
def test_no_restart_where_the_kernel_decides(monkeypatch, madvise_glibc, mode):
    monkeypatch.setattr(hugepages, "_thp_mode", lambda: mode)
    assert hugepages.restart_argv({}) is None


def test_no_restart_without_glibc_tunable(monkeypatch, madvise_glibc):
    monkeypatch.setattr(hugepages, "_glibc_has_tunable", lambda: False)
    assert hugepages.restart_argv({}) is None


def test_peers_get_the_users_environment(monkeypatch):
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", hugepages.BEFORE: "", "A": "1"}
    assert hugepages.user_env(env) == {"A": "1"}
    assert hugepages.user_env({"GLIBC_TUNABLES": "x=1:glibc.malloc.hugetlb=1", hugepages.BEFORE: "x=1"}) == {
        "GLIBC_TUNABLES": "x=1"
    }
    assert hugepages.user_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == {  # the user's own: kept
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"
    }
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.setenv(hugepages.BEFORE, "")
    peer = Launched(["true"], 1, "/tmp/unused.log")
    ours = Launched(["true"], 1, "/tmp/unused.log", ours=True)
    assert "GLIBC_TUNABLES" not in peer.env and hugepages.BEFORE not in peer.env
    assert ours.env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


CHILD = textwrap.dedent("""
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location("hugepages", sys.argv[1])  # by path: no package, no torch
    hugepages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hugepages)
    restart_with_hugepages, status = hugepages.restart_with_hugepages, hugepages.status
    restart_with_hugepages()
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    p = libc.malloc(64 << 20)  # 64 MiB from glibc's malloc (an mmap), as llama.cpp's weight buffers
    ctypes.memset(p, 1, 64 << 20)  # touched (numpy would madvise by itself: not used here)
    huge = [int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")][0]
    print(os.environ.get("GLIBC_TUNABLES"), huge, sys.argv[2:], status(), sep="|")
""")


@pytest.mark.skipif(
    hugepages.restart_argv({}) is None,
    reason="this machine's kernel or C library decides huge pages itself (THP mode not madvise, "
    "or no glibc >= 2.35): nothing to restart for",
)
def test_restarted_process_holds_huge_pages(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.BEFORE, "SPECDECODE_HUGEPAGES")}
    out = subprocess.run(
        [sys.executable, str(script), hugepages.__file__, "a", "b c"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    tunables, huge, args, status = out.stdout.strip().split("|")
    assert tunables == "glibc.malloc.hugetlb=1" and args == "['a', 'b c']", out.stderr
    assert int(huge) >= 32 << 10, f"{huge} kB in huge pages"  # the kernel granted them
    assert "restarted" in status
    off = subprocess.run(
        [sys.executable, str(script), hugepages.__file__],
        env={**env, "SPECDECODE_HUGEPAGES": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert off.stdout.split("|")[:2] == ["None", "0"], off.stdout + off.stderr  # the negative control: no huge pages


@pytest.mark.parametrize(
    "argv, command",
    [
        (["/v/bin/python", "/v/bin/specdecode", "serve"], True),  # the console script
        (["python3", "-m", "specdecode", "bench"], True),
        (["python3", "-u", "-m", "specdecode"], True),
        (["python3", "-X", "dev", "-W", "error", "-uB", "-m", "specdecode.cli", "serve"], True),
        (["python3", "-X", "specdecode"], False),  # an option's argument, not the command
        (["python3", "-", "specdecode"], False),  # a script from stdin must not be started again
        (["python3", "-c", "code", "specdecode"], False),
        (["python3", "-m", "pytest", "tests"], False),  # a program that imports the package
        (["python3", "-m", "specdecode.bench.llama_peer_child"], False),
        (["python3", "my_app.py"], False),
        (["python3", "-c", "import specdecode"], False),
        (["python3"], False),
    ],
)
def test_only_the_command_restarts_at_import(argv, command):
    assert hugepages.launched_as_command(argv) is command


@pytest.mark.process
@pytest.mark.skipif(
    hugepages.restart_argv({}) is None,
    reason="this machine's kernel or C library decides huge pages itself (THP mode not madvise, or "
    "no glibc >= 2.35): the command has nothing to restart for",
)
@pytest.mark.parametrize("command", [["-m", "specdecode"], ["-m", "specdecode.cli"]])
def test_the_command_restarts_itself(tmp_path, command):
    """`python -m specdecode` ends in a process that asked for huge pages: an atexit hook (sitecustomize) prints the
    environment of the process that exits, the restarted one (execve runs no atexit handler of the first)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: sys.stderr.write('ENV|%s|%s\\n' % (os.environ.get('GLIBC_TUNABLES'), "
        "os.environ.get('SPECDECODE_GLIBC_TUNABLES_BEFORE'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.BEFORE, "SPECDECODE_HUGEPAGES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, *command, "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ENV|glibc.malloc.hugetlb=1|" in out.stderr, out.stderr[-2000:]
    off = subprocess.run(
        [sys.executable, *command, "--help"],
        env={**env, "SPECDECODE_HUGEPAGES": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "ENV|None|None" in off.stderr, off.stderr[-2000:]  # the negative control


IMPORT_ONLY = textwrap.dedent("""
    import os, sys
    calls = []
    os.execve = lambda *a: calls.append(a)  # a restart would call it (and not return)
    import specdecode
    imported = (len(calls), "torch" in sys.modules)
    from specdecode.host import restart_if_command
    restart_if_command()  # what the command's main() does first: the negative control
    verify = specdecode.verify.verify_tree  # a submodule, loaded on first use
    print(*imported, len(calls), "torch" in sys.modules, specdecode.Engine.__name__, callable(verify), sep="|")
""")


@pytest.mark.process
def test_importing_the_package_restarts_nothing_and_loads_no_torch(tmp_path):
    """`import specdecode` from a script the huge-pages check takes for the command (it is named `specdecode`) has no
    effect on the process: no restart, no torch; the package's names load on first use."""
    script = tmp_path / "specdecode"
    script.write_text(IMPORT_ONLY)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.BEFORE, "SPECDECODE_HUGEPAGES")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    restarts, torch_at_import, restarts_after, torch_after, engine, verify = out.stdout.strip().split("|")
    assert (restarts, torch_at_import) == ("0", "False"), out.stderr[-2000:]
    assert (torch_after, engine, verify) == ("True", "Engine", "True"), out.stderr[-2000:]  # loaded when named
    if hugepages.restart_argv(env) is not None:  # where a restart applies at all
        assert restarts_after == "1"  # the command's own call restarts: the check above can see one


IMPORT_FROZEN = """
import gc, sys
from specdecode.host import import_frozen
gc.disable()
import_frozen(("email.mime.text",))  # a collector the caller had paused stays paused
paused = (not gc.isenabled(), "email.mime.text" in sys.modules, gc.get_freeze_count() > 0)
gc.enable()
n = gc.get_freeze_count()
import_frozen(("email.mime.text",))  # loaded already: nothing happens
again = gc.get_freeze_count() == n
import_frozen(("xml.dom.minidom",))
print(paused, again, gc.isenabled(), gc.get_freeze_count() > n)
"""


@pytest.mark.process
def test_import_frozen_imports_freezes_and_restores_the_collector():
    """The command's heavy imports (host.import_frozen): imported with the collector paused, the objects frozen, the
    collector left as it was; a second call for modules already loaded freezes nothing more (a test process or a
    program calling main() again keeps its garbage collectable)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_FROZEN], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[0] == "(True, True, True) True True True", out.stderr[-2000:]
