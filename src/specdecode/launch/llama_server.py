"""llama.cpp's own `llama-server` (and `llama-batched-bench`), built offline into the cache.

llama-cpp-python's source package vendors llama.cpp: the same commit as our backend's kernels, server
included. `build()` downloads that source package with pip (or takes an unpacked one), runs CMake on its
`vendor/llama.cpp` (Release, native, no tests, examples, web UI or OpenSSL; static, so the installed
binaries need nothing from the build tree) and installs the two programs into
`cache_dir()/llama-server/<llama-cpp-python version>/bin`. Nothing lands in the git checkout.

    specdecode loadtest --build-llama-server [--llama-src DIR] [--jobs 2]
    python scripts/build_llama_server.py [--src DIR] [--jobs 2]

About 11 minutes on 2 cores. `find_binary("llama-server")` finds it there afterwards (then on PATH).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

from ..host import cache_dir

TARGETS = ("llama-server", "llama-batched-bench")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


def cmake_flags() -> tuple[str, ...]:
    """CMAKE_FLAGS; on x86, as the README builds llama-cpp-python: without llama.cpp's AMX kernels, which GCC 12
    miscompiles (a crash on the first batched matmul on a CPU with AMX; see backends/llamacpp/amx.amx_usable).
    Read at build time: backends/ loads torch, which finding the binary (the load test) never needs."""
    if platform.machine() in ("x86_64", "AMD64"):
        from ..backends import NO_AMX_FLAGS

        return CMAKE_FLAGS + NO_AMX_FLAGS
    return CMAKE_FLAGS


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the vendored llama.cpp commit follows it)."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return "0.3.36"


def bin_dir(version: str | None = None) -> Path:
    return cache_dir() / "llama-server" / (version or llama_cpp_version()) / "bin"


def find_binary(name: str = "llama-server", version: str | None = None) -> Path | None:
    """The cached build of `name` for this llama-cpp-python version, else one on PATH, else None."""
    path = bin_dir(version) / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    found = shutil.which(name)
    return Path(found) if found else None


def _fetch_source(version: str, work: Path, log) -> Path:
    """Download llama-cpp-python's sdist with pip and unpack it; returns the unpacked root."""
    dl = work / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    log(f"downloading llama-cpp-python=={version} (source package) with pip")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"llama-cpp-python=={version}",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(dl),
        ],
        check=True,
    )
    archive = next(dl.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return work / archive.name[: -len(".tar.gz")]


def build(
    version: str | None = None,
    src: str | Path | None = None,
    jobs: int = 2,
    nice: int = 10,
    keep_build: bool = False,
    log=print,
) -> Path:
    """Build llama-server and llama-batched-bench into bin_dir(version); returns that directory.
    `src`: an unpacked llama-cpp-python source package (or its vendor/llama.cpp) to skip the download."""
    version = version or llama_cpp_version()
    out = bin_dir(version)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=_mkdir(out.parent)))
    t0 = time.perf_counter()
    flags = cmake_flags()
    try:
        root = Path(src) if src else _fetch_source(version, work, log)
        tree = root if (root / "tools" / "server").is_dir() else root / "vendor" / "llama.cpp"
        if not (tree / "tools" / "server").is_dir():
            raise SystemExit(f"no llama.cpp tree with tools/server under {root}")
        build_dir = work / "build"
        prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
        log(f"configuring {tree}")
        subprocess.run([*prefix, "cmake", "-S", str(tree), "-B", str(build_dir), *flags], check=True)
        log(f"building {' '.join(TARGETS)} with {jobs} jobs (about 11 minutes on 2 cores)")
        subprocess.run(
            [*prefix, "cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TARGETS],
            check=True,
        )
        out.mkdir(parents=True, exist_ok=True)
        for name in TARGETS:
            shutil.copy2(build_dir / "bin" / name, out / name)
        version_text = subprocess.run([str(out / "llama-server"), "--version"], capture_output=True, text=True)
        (out.parent / "BUILD_INFO.txt").write_text(
            f"llama-cpp-python {version}\nsource {tree}\nflags {' '.join(flags)}\n"
            f"build seconds {time.perf_counter() - t0:.0f}\n{version_text.stdout}{version_text.stderr}"
        )
        log(f"installed {', '.join(TARGETS)} in {out} ({time.perf_counter() - t0:.0f} s)")
        return out
    finally:
        if not keep_build:
            shutil.rmtree(work, ignore_errors=True)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
