"""Build llama.cpp's own llama-server and llama-batched-bench offline into the cache.

    python scripts/build_llama_server.py [--src DIR] [--jobs 2] [--nice 10] [--keep-build]

Same as `specdecode loadtest --build-llama-server`; see specdecode/launch/llama_server.py. The binaries
land in $SPECDECODE_CACHE (default ~/.cache/specdecode)/llama-server/<llama-cpp-python version>/bin.
"""

from __future__ import annotations

import argparse

from specdecode.launch.llama_server import build


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="an unpacked llama-cpp-python source package (default: pip download it)")
    ap.add_argument("--version", help="llama-cpp-python version (default: the installed one)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--keep-build", action="store_true", help="keep the CMake build directory")
    args = ap.parse_args()
    build(args.version, args.src, jobs=args.jobs, nice=args.nice, keep_build=args.keep_build)


if __name__ == "__main__":
    main()
