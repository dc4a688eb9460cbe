"""Rules of numeric and enumerated options: one rule per option, one message format.

A :class:`Number` is the rule of a numeric option (integer or real, bounds, unit, what a special
value means). Calling it checks a value and returns it normalised (an ``int``, or a ``float``),
or raises :class:`~tierckpt.errors.ConfigError` naming the option and the values it accepts::

    positive_int(unit="steps")(5, "intervals.local")  # -> 5
    positive_int(unit="steps")(0, "intervals.local")
    # ConfigError: intervals.local: must be an integer number of steps >= 1, got 0

:mod:`tierckpt.config` defines each option's rule once (:data:`tierckpt.config.RULES`,
:data:`tierckpt.config.SCHEDULE_RULES`); the torchtitan and Megatron adapters check their keys
and flags with those same rules, under the name the user wrote (``checkpoint.interval``,
``--ckpt-plugin-local-wait-timeout``), so an option cannot have one bound in the engine and
another in a front end.

Rejected wherever a number is expected: ``bool`` (an ``int`` subclass: ``True`` would pass as
1), NaN and ±inf (a later ``timedelta`` or ``Event.wait`` would raise ``OverflowError`` far from
the config), strings and every other type. Options that are waits carry an upper bound (a
finite but huge wait overflows the same way).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt.errors import ConfigError

__all__ = ["Number", "boolean", "choice", "fraction", "non_negative_int", "non_negative_seconds",
           "optional", "positive_int", "positive_number", "positive_seconds"]


def _fmt(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Number:
    """The rule of one numeric option.

    Attributes:
        integer: an integral value (``int`` or another ``numbers.Integral``; ``2.0`` is refused),
            else any finite real.
        min, max: bounds (None: unbounded on that side).
        min_open: ``min`` itself is refused (``> min`` rather than ``>= min``).
        max_label: how the message writes ``max`` when it is derived from another option
            (``"collective_timeout_s / 2 = 300"``).
        unit: ``"seconds"``, ``"steps"``, ``"bytes"``, ... (message only; no conversion).
        note: what a special value means, e.g. ``"0 keeps all"``.
        multiple_of: the value must be a multiple of this (integers only).
        none_means: not None: None is accepted (and returned) and means this, e.g.
            ``"min(60, collective_timeout_s / 3)"``.
    """

    integer: bool = False
    min: float | None = None
    min_open: bool = False
    max: float | None = None
    max_label: str | None = None
    unit: str = ""
    note: str = ""
    multiple_of: int | None = None
    none_means: str | None = None

    def describe(self) -> str:
        """The accepted values in words: ``"a number of seconds in [0, 604800] (0 = no limit)"``."""
        noun = "an integer" if self.integer else "a number"
        if self.unit:
            noun += f" number of {self.unit}" if self.integer else f" of {self.unit}"
        if self.max is not None:
            lo = "(" if self.min_open else "["
            rng = f" in {lo}{_fmt(self.min if self.min is not None else -math.inf)}, " \
                  f"{self.max_label or _fmt(self.max)}]"
        elif self.min is None:
            rng = ""
        else:
            rng = f" {'>' if self.min_open else '>='} {_fmt(self.min)}"
        text = noun + rng
        if self.multiple_of:
            text += f", a multiple of {self.multiple_of}"
        if self.note:
            text += f" ({self.note})"
        if self.none_means is not None:
            text += f", or None ({self.none_means})"
        return text

    def _fail(self, value, option: str) -> ConfigError:
        return ConfigError(option, f"must be {self.describe()}, got {value!r}")

    def __call__(self, value, option: str):
        """Check ``value`` for ``option``.

        Returns:
            ``int(value)`` (integer rules) or ``float(value)``; None when None is allowed.

        Raises:
            ConfigError: naming ``option``, with :meth:`describe` and the value.
        """
        if value is None and self.none_means is not None:
            return None
        v: int | float
        if isinstance(value, bool):  # an int subclass: True would pass as 1
            raise self._fail(value, option)
        if isinstance(value, numbers.Integral):  # numpy integers too
            v = int(value) if self.integer else float(value)
        elif isinstance(value, numbers.Real) and not self.integer:
            v = float(value)
        else:
            raise self._fail(value, option)
        if not math.isfinite(v):
            raise self._fail(value, option)
        if self.min is not None and (v < self.min or (self.min_open and v == self.min)):
            raise self._fail(value, option)
        if self.max is not None and v > self.max:
            raise self._fail(value, option)
        if self.multiple_of and v % self.multiple_of:
            raise self._fail(value, option)
        return v

    def parse(self, text: str, option: str):
        """Check a command-line ``text`` (``int(text)`` or ``float(text)``, then the rule).

        Raises:
            ConfigError: naming ``option``; ``text`` is not a number, or out of range.
        """
        try:
            value = int(text) if self.integer else float(text)
        except (TypeError, ValueError):
            raise self._fail(text, option) from None
        return self(value, option)

    def with_max(self, max: float, label: str | None = None) -> Number:
        """This rule with upper bound ``max`` (derived from another option: name it in ``label``)."""
        return dataclasses.replace(self, max=max, max_label=label)


def positive_int(*, unit: str = "", note: str = "") -> Number:
    """An integer >= 1 (steps, replicas, buffers)."""
    return Number(integer=True, min=1, unit=unit, note=note)


def non_negative_int(*, unit: str = "", note: str = "") -> Number:
    """An integer >= 0; ``note`` says what 0 means."""
    return Number(integer=True, min=0, unit=unit, note=note)


def positive_seconds(*, max: float | None = None, note: str = "") -> Number:
    """Finite seconds > 0, at most ``max`` (give one for every wait: a huge wait overflows)."""
    return Number(min=0, min_open=True, max=max, unit="seconds", note=note)


def non_negative_seconds(*, max: float | None = None, note: str = "") -> Number:
    """Finite seconds >= 0, at most ``max``; ``note`` says what 0 means."""
    return Number(min=0, max=max, unit="seconds", note=note)


def positive_number(*, unit: str = "") -> Number:
    """A finite real > 0 (a prior's strength, hours of MTBF)."""
    return Number(min=0, min_open=True, unit=unit)


def fraction() -> Number:
    """A finite real in (0, 1] (a share, a smoothing weight)."""
    return Number(min=0, min_open=True, max=1)


def optional(rule: Number, none_means: str) -> Number:
    """``rule`` that also accepts None, documented as meaning ``none_means``."""
    return dataclasses.replace(rule, none_means=none_means)


def choice(value, option: str, allowed: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``allowed``.

    Raises:
        ConfigError: naming ``option``: ``must be 'a' or 'b', got 'c'``.
    """
    if not isinstance(value, str) or value not in allowed:
        names = [repr(a) for a in allowed]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise ConfigError(option, f"must be {listed}, got {value!r}")
    return value


def boolean(value, option: str) -> bool:
    """``value`` if it is a ``bool`` (``1`` or ``"yes"`` are refused: a typed config says true/false).

    Raises:
        ConfigError: naming ``option``.
    """
    if not isinstance(value, bool):
        raise ConfigError(option, f"must be true or false, got {value!r}")
    return value
