"""PEP 562 lazy exports shared by :mod:`tierckpt` and :mod:`tierckpt.integration`.

A package module lists ``name -> defining module`` and gets a module ``__getattr__`` that
imports the defining module on first use, so ``import tierckpt`` (and the ``tierckpt`` command)
does not import torch.distributed until an engine class is used.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Callable, Mapping


def lazy_exports(
    package: str,
    exports: Mapping[str, str],
    moved: Mapping[str, str] | None = None,
    namespace: dict | None = None,
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package``.

    Args:
        package: the module's name, for error and warning messages.
        exports: public name -> module that defines it; resolved on first access and cached in
            ``namespace`` (the module's ``globals()``), so later accesses cost nothing.
        moved: former public names -> the module they now live in. Accessing one still works
            for one release but emits a :class:`DeprecationWarning` naming the new import (not
            cached, so every ``from package import name`` warns).
        namespace: the module's ``globals()``.

    Returns:
        ``(__getattr__, __dir__)``; the module's own ``def __getattr__`` must call the first
        directly (the warning's stack level counts on it). ``__getattr__`` raises
        :class:`AttributeError` for any other name, as a module without it would.
    """
    moved = dict(moved or {})
    ns = namespace if namespace is not None else {}

    def __getattr__(name: str) -> object:
        mod = exports.get(name)
        if mod is not None:
            value = getattr(importlib.import_module(mod), name)
            ns[name] = value
            return value
        new_home = moved.get(name)
        if new_home is not None:
            warnings.warn(f"'{package}.{name}' is deprecated and will be removed in the next release; "
                          f"import it from '{new_home}' (from {new_home} import {name})",
                          DeprecationWarning, stacklevel=3)  # the user's line: past the module's __getattr__
            return getattr(importlib.import_module(new_home), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(ns) | set(exports))

    return __getattr__, __dir__
