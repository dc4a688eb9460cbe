"""``tierckpt ls``'s "kept because" column: why retention keeps each committed step.

Retention records its last decision in the ``tierckpt-retention.json`` of every root it runs on
(the persistent root, each node's local root; :mod:`tierckpt.tiers.retention`): the reasons of
each step it kept (``newest 2``, ``every 50 steps``, ``one per 3600 s``, ``period 100``,
``milestone``, ``restored from``, ``local anchor``; :mod:`tierckpt.tiers.keep`). A committed
step the record does not name as the same save was committed after the last pass (the newest
save of a run that ended before its retention), or the root was never retained by this
version: its reasons are unknown (None).
"""

from __future__ import annotations

from typing import Any

from tierckpt.tiers.retention import read_record

StepDir = Any
"""A :class:`tierckpt.cli.steps.StepDir` (``store``, ``rel``, ``tier``, ``step``, ``committed``,
``save``); not imported: that module imports this one."""

_DEPTH = {"persistent": 1, "local": 2, "replica": 3}
"""Path components between a step directory and the root that holds its record (``step-N``;
``local/step-N``; ``replicas/node-m/step-N``)."""


def split_root(s: StepDir) -> tuple[str, str, int]:
    """(the root holding ``s``'s record, relative to ``s.store``; ``s``'s parent directory inside
    that root, as the record names it; the step)."""
    parts = s.rel.split("/")
    n = _DEPTH.get(s.tier, 1)
    return "/".join(parts[:-n]), "/".join(parts[-n:-1]), s.step


def kept_because(steps: list[StepDir]) -> dict[int, list[str] | None]:
    """``{id(step dir): reasons}`` for every committed one of ``steps``: the reasons the last
    retention pass recorded for that save, None when unknown (module docstring)."""
    records: dict[tuple[int, str], dict] = {}
    out: dict[int, list[str] | None] = {}
    for s in steps:
        if not s.committed:
            continue
        root, parent, step = split_root(s)
        key = (id(s.store), root)
        if key not in records:
            records[key] = read_record(s.store, root) or {}
        sid, why = records[key].get(parent, {}).get(step, (None, None))
        out[id(s)] = list(why) if why is not None and sid == s.save[0] else None
    return out


def label(reasons: list[str] | None, committed: bool) -> str:
    """The table's text: the reasons joined, ``?`` for a committed step without a recorded
    reason, empty for an uncommitted one."""
    if not committed:
        return ""
    return ", ".join(reasons) if reasons else "?"
