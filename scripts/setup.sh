#!/usr/bin/env bash
# Set up a clone: a virtual environment in .venv with torch, llama-cpp-python built for this CPU, and specdecode
# itself (editable) with the extras named. Usage: scripts/setup.sh [EXTRAS], e.g. `scripts/setup.sh models,test`
# (default: models). Run again, it keeps the .venv and the pinned torch and llama-cpp-python already in it.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-models}"
TORCH=2.13.0
LLAMA_CPP=0.3.36

[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate

# whether package $1 is installed at version $2 (a local tag such as torch's +cpu counts as the same version)
installed() {
    local version
    version="$(python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null)" || return 1
    [ "${version%%+*}" = "$2" ]
}

if installed torch "$TORCH"; then
    echo "setup: torch $TORCH already installed"
else
    pip install "torch==$TORCH"
fi

if installed llama_cpp_python "$LLAMA_CPP"; then
    echo "setup: llama-cpp-python $LLAMA_CPP already installed, not rebuilt"
elif [ "$(uname -s)/$(uname -m)" = Linux/x86_64 ]; then
    # x86 Linux (what CI runs): compiled for this CPU, without llama.cpp's AMX kernels, which GCC 12 miscompiles
    # (docs/guide/backends.md); --no-cache-dir so that pip never hands back a build made for another CPU
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" \
        pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP"
else
    # aarch64 Linux, macOS: llama-cpp-python's own build (the AMX flags are x86-only); not tested in CI
    echo "setup: $(uname -s)/$(uname -m) is not x86 Linux: plain llama-cpp-python build, not tested in CI"
    pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP"
fi

pip install -e ".[$EXTRAS]"
