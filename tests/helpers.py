"""Helpers shared by several test modules (test modules do not import from each other)."""
from __future__ import annotations

import importlib.metadata as md

import pytest

from specdecode.models import BUILTIN, DEFAULT_DRAFT, DEFAULT_TARGET


def default_pair_installed() -> bool:
    """Whether the packages that carry the default pair's GGUF chunks are installed (the `models` extra)."""
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        for req in BUILTIN[name].requirements():
            package, version = req.split("==")
            try:
                if md.version(package) != version:
                    return False
            except md.PackageNotFoundError:
                return False
    return True


# for tests that need the real default pair: slow, and skipped (with the reason) where it is not installed
DEFAULT_PAIR_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(not default_pair_installed(),
                       reason='the default pair is not installed (pip install -e ".[models]"; CI installs it)'),
]


def needs_default_pair(test):
    for mark in DEFAULT_PAIR_MARKS:
        test = mark(test)
    return test
