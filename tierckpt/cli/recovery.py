"""The recovery timeline as a table (``tierckpt ledger``; the demos' reports print it too)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tierckpt.cli.common import _fmt_time, human_bytes
from tierckpt.records import RecoveryRecord

__all__ = ["recovery_lines", "recovery_table", "recovery_title", "recovery_view"]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def recovery_title(rec: RecoveryRecord) -> str:
    """``recovery: step S, <cause>, attempt A, failed nodes [..]`` (what is known of them)."""
    attempt = "" if rec.attempt is None else f", attempt {rec.attempt}"
    failed = f", failed nodes {rec.failed_nodes}" if rec.failed_nodes else ""
    return f"recovery: step {rec.step}, {rec.cause}{attempt}{failed}"


def recovery_table(rec: RecoveryRecord, title: str | None = None) -> Table:
    """One ``recovery`` record's phases as a rich table: each phase (in order), its seconds since
    the failure was noticed (since the earliest process start for a restart without a launcher
    failure) and since the known phase before it.

    Args:
        rec: the record.
        title: the table's title (default :func:`recovery_title`; ``""``: none).
    Returns:
        a :class:`rich.table.Table` (unknown values print as ``-``).
    """
    since = "failure noticed" if rec.origin == "failure_noticed" else "process start"
    t = Table(title=recovery_title(rec) if title is None else (title or None))
    t.add_column("phase")
    t.add_column(f"s since {since}", justify="right")
    t.add_column("+ s", justify="right")
    prev: float | None = None
    for phase, s in rec.phase_rows():
        t.add_row(phase.replace("_", " "), _s(s), _s(None if s is None or prev is None else s - prev))
        prev = s if s is not None else prev
    return t


def recovery_lines(rec: RecoveryRecord) -> list[str]:
    """What the table leaves out, one short line each: when, the total, each node's restore
    source and bytes and its process start and imports, the replacements, the notes."""
    warm = "" if rec.warm is None else f", {'warm' if rec.warm else 'cold'} processes"
    lines = [f"recovered {_fmt_time(rec.time)}; total (failure noticed → first step): {_s(rec.total_s)} s{warm}"]
    for node, v in sorted(rec.nodes.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 1 << 30):
        if not isinstance(v, dict):
            continue
        holder = v.get("holder")
        src = f"{v.get('source')}" + (f"@{holder}" if holder is not None else "")
        nbytes = v.get("bytes")
        lines.append(f"node {node}: {src}, {human_bytes(nbytes) if isinstance(nbytes, int) else '-'}, "
                     f"started {_s(v.get('processes_started_s'))} s, imports {_s(v.get('imports_done_s'))} s")
    lines += [f"node {node} replaced by {what}" for node, what in sorted(rec.replaced.items())]
    return lines + [f"note: {n}" for n in rec.notes]


def recovery_view(rec: RecoveryRecord, title: str | None = None) -> Group:
    """The title (default :func:`recovery_title`) on a line of its own, :func:`recovery_table`
    and :func:`recovery_lines`, for ``Console.print``."""
    return Group(Text(recovery_title(rec) if title is None else title, style="italic"), recovery_table(rec, ""),
                 *(Text(line) for line in recovery_lines(rec)))
