import gc
import os
import sys
from pathlib import Path

import pytest

# llama.cpp's passes are OpenMP teams (default_threads(): every core) whose threads spin at each of a graph's many
# barriers; beside another busy worker, a spinning thread holds the core its teammate waits for, and a pass takes a
# scheduler slice per barrier (the 2-thread exact-mode measurement: 97 s spinning, 1.7 s sleeping, the same limits).
# libgomp reads the policy once, when it loads, and llama.cpp shares torch's copy: set before torch is imported. It
# reaches the processes the tests start too. Bits do not depend on it, only how a waiting thread waits.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).parent))

DEFAULT_THREADS = None  # torch's own thread count, before pytest_configure sets one (the default-pair test restores it)


@pytest.hookimpl(trylast=True)  # after xdist's, which registers its controller ("dsession")
def pytest_configure(config):
    """In a process that runs tests: torch at one thread, and the heavy imports' objects frozen. Not in xdist's
    controller, which only hands tests out: it is spared torch's and transformers' import, seconds before any
    worker starts."""
    global DEFAULT_THREADS
    if config.pluginmanager.hasplugin("dsession"):
        return
    from specdecode.host import import_frozen

    # torch and transformers' Qwen2 (tiny.py), which every worker loads, imported as the command imports them: their
    # millions of lifelong objects frozen, which every full collection walked (a third of a worker's start); the
    # tests' own garbage is collected as before
    import_frozen(("torch", "tiny"))
    import torch

    # Tiny models gain nothing from a second thread, and OpenMP threads that spin-wait for a busy core
    # make them many times slower on a shared 2-core machine.
    DEFAULT_THREADS = torch.get_num_threads()
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    gc.freeze()  # what the test modules imported, likewise


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests, whatever a module before it set (tiny models are fastest on one thread,
    and far slower on two threads sharing busy cores); the count before is restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target_dir, draft_dir): tiny fp32 models saved as HF directories with a byte tokenizer."""
    from tiny import save_tiny

    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "target", seed=0), save_tiny(root / "draft", seed=1)


@pytest.fixture(scope="session")
def make_engine():
    """The Engine factory on the tiny fp32 models: make_engine(target=0, draft=1, tokenizer=None, *, costs=None,
    progress=None, **Engine kwargs) builds a fresh Engine (tiny.build_engine); draft=None leaves the draft out.
    Session-scoped (it holds no state), so module fixtures can use it too."""
    from tiny import build_engine

    return build_engine


@pytest.fixture(scope="session")
def tiny_engine(make_engine):
    """One Engine on the tiny models (target seed 0, draft seed 1) shared by the whole session."""
    return make_engine()


@pytest.fixture(scope="module")
def _module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("module-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path, monkeypatch):
    """A cache of each test's own; one for the whole module where it sets SHARED_CACHE = True (its servers: the first
    start-up measures the tiny models' pass costs, the others read them, as every server after the first does)."""
    shared = getattr(request.module, "SHARED_CACHE", False)
    cache = request.getfixturevalue("_module_cache") if shared else tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
