"""scripts/setup.sh, the README's and CI's set-up, run against a stand-in .venv whose `pip` and `uname` only
record what they were asked: which llama-cpp-python build each machine gets, and what an existing .venv keeps."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process

STUB_PIP = '#!/bin/sh\necho "CMAKE_ARGS=${CMAKE_ARGS:-} pip $*" >> "$PIP_LOG"\n'
STUB_UNAME = '#!/bin/sh\ncase "$1" in -s) echo "$FAKE_OS" ;; -m) echo "$FAKE_ARCH" ;; esac\n'


def run_setup(tmp_path: Path, machine: str, installed: dict[str, str] = {}, extras: str = "models,test") -> list[str]:
    """The pip commands setup.sh runs on `machine` ("Linux/x86_64"), with `installed` {dist: version} in .venv."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_bytes((ROOT / "scripts" / "setup.sh").read_bytes())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    bin_dir = tmp_path / ".venv" / "bin"
    for name, text in (("pip", STUB_PIP), ("uname", STUB_UNAME)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    site = next((tmp_path / ".venv" / "lib").glob("python*/site-packages"))
    for dist, version in installed.items():
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    log = tmp_path / "pip.log"
    fake_os, fake_arch = machine.split("/")
    env = {**os.environ, "PIP_LOG": str(log), "FAKE_OS": fake_os, "FAKE_ARCH": fake_arch}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh"), extras],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    return log.read_text().splitlines()


def test_setup_script_is_executable_and_parses():
    script = ROOT / "scripts" / "setup.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_x86_linux_builds_llama_cpp_without_amx_kernels(tmp_path):
    calls = run_setup(tmp_path, "Linux/x86_64")
    assert calls[0] == "CMAKE_ARGS= pip install torch==2.13.0"
    assert calls[1].startswith("CMAKE_ARGS=-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 ")
    assert calls[1].endswith("pip install --no-cache-dir llama-cpp-python==0.3.36")
    assert calls[2:] == ["CMAKE_ARGS= pip install -e .[models,test]"]


@pytest.mark.parametrize("machine", ["Linux/aarch64", "Darwin/arm64"])
def test_other_machines_get_the_plain_llama_cpp_build(tmp_path, machine):
    calls = run_setup(tmp_path, machine, extras="models")
    assert calls[1] == "CMAKE_ARGS= pip install --no-cache-dir llama-cpp-python==0.3.36"
    assert calls[2:] == ["CMAKE_ARGS= pip install -e .[models]"]


def test_an_existing_venv_keeps_its_torch_and_llama_cpp_build(tmp_path):
    calls = run_setup(tmp_path, "Linux/x86_64", {"torch": "2.13.0+cpu", "llama_cpp_python": "0.3.36"})
    assert calls == ["CMAKE_ARGS= pip install -e .[models,test]"]


def test_another_llama_cpp_version_is_replaced(tmp_path):
    calls = run_setup(tmp_path, "Linux/x86_64", {"torch": "2.13.0", "llama_cpp_python": "0.3.2"})
    assert [c for c in calls if "llama-cpp-python" in c] and "torch" not in " ".join(calls)
