"""llama.cpp's AMX kernels, and whether this build's run: a build with AMX_INT8 (made natively on a CPU with AMX)
puts the weights of the types below in AMX buffers whenever extra buffers (repacking) are on."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

# ggml types with AMX kernels (ggml-cpu/amx: qtype_has_amx_kernels, and F16)
AMX_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "F16"})
# The child's check: the file's weights in AMX buffers (repack on), one batched pass and one 1-token pass.
AMX_PROBE = (
    "import os, sys; os.environ['SPECDECODE_AMX_PROBE'] = '1'; "
    "from specdecode.backends.llamacpp import LlamaLM; "
    "lm = LlamaLM(sys.argv[1], n_ctx=64, repack=True); lm.forward(list(range(1, 17))); lm.forward([1])"
)
# CMake flags that build llama.cpp without its AMX kernels (scripts/setup.sh on x86 Linux, the llama-server build)
NO_AMX_FLAGS = ("-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8")
AMX_FIX = (
    f'CMAKE_ARGS="-DLLAVA_BUILD=OFF {" ".join(NO_AMX_FLAGS)}" '
    "pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python==0.3.36"
)
_amx_usable: dict[str, bool] = {}


def _system_info(lc) -> bytes:
    return lc.llama_print_system_info() or b""


def _amx_weight_types(path: Path) -> set[str]:
    """The file's tensor types that llama.cpp would put in AMX buffers."""
    import gguf

    try:
        return {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} & AMX_TYPES
    except (OSError, ValueError):  # not a GGUF file llama.cpp could load either: its loading gives the clear error
        return set()


def amx_usable(path: str | Path, lc) -> bool:
    """Whether this llama.cpp build's AMX kernels run here on the file's weights. A build with AMX_INT8 (made
    on a CPU that has AMX) puts such weights in AMX buffers whenever repacking is on; compiled by GCC 12, the
    first batched matmul there dies of a general protection fault (its `_tile_loadconfig` declares an 8-byte
    operand, so the stores of the tile shapes before it are dropped as dead and `ldtilecfg` reads stack
    garbage; seen with llama-cpp-python 0.3.36: docs/results/notes.md#code-amx-crash). Checked once
    per library build, CPU and file, in a child process (where a crash costs nothing), and cached.
    lc: llama-cpp-python's bindings (lm._lib())."""
    path = Path(path)
    if os.environ.get("SPECDECODE_AMX_PROBE") or b"AMX_INT8 = 1" not in _system_info(lc):
        return True
    from ...host import cache_dir, cpu_name, write_json

    lib = Path(lc.__file__).parent / "lib"
    st = path.stat()
    parts = [cpu_name(), str(path.resolve()), str(st.st_size), str(st.st_mtime_ns)]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(lib.glob("libggml-cpu*"))]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    if key in _amx_usable:
        return _amx_usable[key]
    record = cache_dir() / "costs" / f"amx-{key}.json"
    try:
        info = json.loads(record.read_text())
        usable, status = bool(info["usable"]), int(info["returncode"])
    except (OSError, ValueError, KeyError, TypeError):
        usable, status = True, 0
        if _amx_weight_types(path):  # else nothing of this file goes to AMX buffers (F32 weights, say)
            sys.stderr.write("specdecode: checking that llama.cpp's AMX kernels run on this CPU (once)\n")
            try:
                child = subprocess.run([sys.executable, "-c", AMX_PROBE, str(path)], capture_output=True, timeout=900)
                status, tail = child.returncode, child.stderr.decode("utf-8", "replace")[-2000:]
            except subprocess.TimeoutExpired:
                status, tail = -1, "no answer in 900 s"
            usable = status == 0
            write_json(
                record,
                {"usable": usable, "returncode": status, "cpu": cpu_name(), "file": str(path), "stderr_tail": tail},
                indent=1,
            )
    if not usable:  # every process that loads the file says so, once
        sys.stderr.write(
            f"specdecode: warning: this llama.cpp build's AMX kernels fail on this CPU (check exit status "
            f"{status}, {record}); {path.name} runs without repacked weights (slower). To fix, rebuild "
            f"without AMX: {AMX_FIX}\n"
        )
    _amx_usable[key] = usable
    return usable
