"""Names a package loads on first use (PEP 562): its __init__ maps each public name to the module that defines it,
and importing the package imports none of them (no torch, no server packages, no llama.cpp bindings)."""

from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, exports: dict[str, str], modules: tuple[str, ...] = ()):
    """(__getattr__, __dir__) for the package named `package`: a name in `exports` (name -> module, relative to the
    package) is imported on first use and then kept in the package's namespace; so is a submodule named in
    `modules`, as the module itself."""

    def __getattr__(name: str):
        if name in modules:
            return importlib.import_module(f".{name}", package)  # the import system sets it on the package
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # looked up once
        return value

    def __dir__() -> list[str]:
        namespace = vars(sys.modules[package])
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
