"""Typed read-only attributes: a descriptor in place of ``property(lambda self: ...)``.

:class:`ReadOnly` exposes an attribute held under another name (``"_cfg"``, or a dotted path
such as ``"_gate.history"``) under its declared type, with no setter::

    class Engine:
        cfg: ReadOnly[TierConfig] = ReadOnly("_cfg", "the configuration")

    Engine(...).cfg          # a TierConfig, to mypy and at run time
    Engine(...).cfg = other  # mypy: error [assignment]; at run time: AttributeError

It is not a method: ``tierckpt_dev/shape_check.py`` counts an engine's ``ReadOnly`` attributes
apart from its methods (a ``property(...)`` or a lambda in a class body counts as a method).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Generic, NoReturn, TypeVar, overload

__all__ = ["ReadOnly"]

T = TypeVar("T")


class ReadOnly(Generic[T]):
    """A read-only attribute of type ``T`` (declare it as ``name: ReadOnly[T] = ReadOnly(path)``).

    Args:
        path: the attribute read, on the instance: a name (``"_cfg"``) or a dotted path
            (``"_resume.last_redundancy"``).
        doc: the attribute's docstring (``help()``, IDEs).
        copy: applied to the value on each read (e.g. ``list``: a snapshot of a list the
            object keeps appending to), or None: the value itself.
    """

    def __init__(self, path: str, doc: str = "", *, copy: Callable[[Any], T] | None = None) -> None:
        self.path, self.name, self._copy = path, path.rsplit(".", 1)[-1].lstrip("_"), copy
        self._get = operator.attrgetter(path)
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = self.__doc__ or f"read-only: see {owner.__name__} ({name})"

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> ReadOnly[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> T | ReadOnly[T]:
        if obj is None:  # on the class: the descriptor itself (help(), documentation tools)
            return self
        value = self._get(obj)
        return value if self._copy is None else self._copy(value)

    def __set__(self, obj: object, value: NoReturn) -> NoReturn:
        """Refused: no value has type ``NoReturn``, so mypy rejects every assignment; at run time
        it raises."""
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")

    def __delete__(self, obj: object) -> NoReturn:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")

    def __repr__(self) -> str:
        return f"ReadOnly({self.path!r})"
