"""``tierckpt ls``, ``verify`` and ``ledger``: find, classify and re-hash step directories of any tier."""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich.table import Table
from rich.text import Text

from tierckpt.cli.common import (
    DEFAULT_MAX_DEPTH,
    EXIT_CORRUPT,
    EXIT_OK,
    TIER_ORDER,
    CliError,
    _fmt_seconds,
    _fmt_sources,
    _fmt_time,
    _print_json,
    _short,
    _stdout,
    human_bytes,
)
from tierckpt.errors import ConfigError
from tierckpt.history import lineage
from tierckpt.cli.kept import kept_because
from tierckpt.cli.kept import label as kept_label
from tierckpt.cli.recovery import recovery_view
from tierckpt.history.ledger import Ledger, summarize
from tierckpt.history.timeline import abandoned_saves, descent_of, is_legacy, of_manifest, save_key
from tierckpt.io import manifest
from tierckpt.io.layout import LEDGER, LEDGER_DIR, LINEAGE, MARKER, parse_node, parse_step
from tierckpt.io.storage import Store
from tierckpt.records import RecoveryRecord, RestoreRecord


# --------------------------------------------------------------------------------------------
# finding and classifying step directories
# --------------------------------------------------------------------------------------------
@dataclass
class StepDir:
    """One ``step-<N>`` directory found under the root.

    Attributes:
        store: the store ``rel`` is relative to.
        rel: path of the step directory inside ``store`` (never empty).
        tier: ``"local"``, ``"replica"`` or ``"persistent"`` (from the directory's position).
        step: N.
        node: node whose local root holds it (the holder, for a replica); None if unknown or
            persistent.
        source_node: for a replica, the node whose checkpoint it copies; else None.
        manifest: the committed manifest, or None when the step is not committed.
        marker_present: a commit marker file exists (even if it does not match the manifest).
    """

    store: Store
    rel: str
    tier: str
    step: int
    node: int | None
    source_node: int | None
    manifest: dict | None = None
    marker_present: bool = False
    _size_cache: tuple[int, int] | None = field(default=None, init=False, repr=False)

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def lineage(self) -> str | None:
        """Lineage id the committed manifest records (None: uncommitted, or none recorded)."""
        return lineage.of_manifest(self.manifest)

    @property
    def save(self) -> tuple[str | None, tuple[int, int]]:
        """(save_id, save_order) the committed manifest records (:func:`tierckpt.history.timeline.of_manifest`)."""
        return of_manifest(self.manifest)

    def save_label(self) -> str:
        """``<generation>.<seq>`` of its save, ``-`` for an uncommitted copy or one without identity."""
        sid, order = self.save
        return "-" if not self.committed or is_legacy(sid, order) else f"{order[0]}.{order[1]}"

    def foreign(self, lineage_id: str | None) -> bool:
        """Whether restore ignores this committed node-local step or replica because it belongs
        to another lineage than ``lineage_id`` (never for persistent steps; False when
        ``lineage_id`` is None)."""
        return (lineage_id is not None and self.committed and self.tier in ("local", "replica")
                and self.lineage != lineage_id)

    @property
    def path(self) -> str:
        """Absolute path or URL of the step directory."""
        return self.store.url_of(self.rel)

    def files_and_bytes(self) -> tuple[int, int]:
        """(file count, bytes): from the manifest if committed, else the data files on disk."""
        if self.manifest is not None:
            files = self.manifest.get("files", [])
            total = self.manifest.get("total_bytes")
            if total is None:
                total = sum(int(f.get("size", 0)) for f in files)
            return len(files), int(total)
        if self._size_cache is None:
            names = manifest.data_files(self.store, self.rel)
            total = 0
            for name in names:
                try:
                    total += self.store.size(f"{self.rel}/{name}")
                except OSError:
                    pass
            self._size_cache = (len(names), total)
        return self._size_cache

    def node_label(self) -> str:
        node = "?" if self.node is None else str(self.node)
        if self.tier == "replica":
            return f"{node} (replica of node {self.source_node})"
        if self.tier == "persistent":
            return "-"
        return node

    def sort_key(self):
        big = 1 << 62
        return (
            TIER_ORDER.get(self.tier, 9),
            big if self.node is None else self.node,
            big if self.source_node is None else self.source_node,
            self.step,
            self.rel,
        )


def _nearest_node(parts: list[str]) -> int | None:
    """The id of the nearest ``node-<n>`` component, searching from the end of ``parts``."""
    for p in reversed(parts):
        n = parse_node(p)
        if n is not None:
            return n
    return None


def classify(parts: list[str]) -> tuple[str, int | None, int | None]:
    """Tier, holder node and source node of a step directory from its path components.

    Args:
        parts: components of the step directory's path, the last one being ``step-<N>``.

    Returns:
        ``(tier, node, source_node)``: ``local`` when the parent is ``local`` (node from a
        ``node-<n>`` component above it); ``replica`` when the parent is ``node-<m>`` inside
        ``replicas`` (source m, holder from a ``node-<n>`` component above ``replicas``);
        otherwise ``persistent`` with no node.
    """
    parent = parts[-2] if len(parts) >= 2 else ""
    if parent == "local":
        return "local", _nearest_node(parts[:-2]), None
    m = parse_node(parent)
    if m is not None and len(parts) >= 3 and parts[-3] == "replicas":
        return "replica", _nearest_node(parts[:-3]), m
    return "persistent", None, None


def open_root(root: str) -> Store:
    """A :class:`Store` for ``root`` after checking it is an existing directory.

    Raises:
        CliError: the URL cannot be opened, or it is missing or not a directory.
    """
    try:
        store = Store(root)
        exists = store.exists("")
        isdir = store.isdir("") if exists else False
    except (ImportError, ValueError, OSError) as e:
        raise CliError(f"cannot open {root!r}: {e}") from None
    if not exists:
        raise CliError(f"{root!r} does not exist")
    if not isdir:
        raise CliError(f"{root!r} is not a directory")
    return store


def _parent_store(store: Store) -> tuple[Store, str]:
    """(store of the parent directory, name of ``store``'s root in it)."""
    if store.local:
        return Store(os.path.dirname(store.root)), os.path.basename(store.root)
    url = store.url_of().rstrip("/")
    return Store(posixpath.dirname(url)), posixpath.basename(url)


def _walk_steps(store: Store, rel: str, depth: int, max_depth: int) -> Iterator[str]:
    for name in store.listdir(rel):
        child = f"{rel}/{name}" if rel else name
        if not store.isdir(child):
            continue
        if parse_step(name) is not None:
            yield child  # never descend into a step directory
        elif depth < max_depth:
            yield from _walk_steps(store, child, depth + 1, max_depth)


def find_steps(root: str, max_depth: int = DEFAULT_MAX_DEPTH) -> list[StepDir]:
    """Every ``step-<N>`` directory under ``root`` (or ``root`` itself), classified and sorted.

    Args:
        root: local path or fsspec URL.
        max_depth: directory levels below ``root`` searched.

    Returns:
        :class:`StepDir` list sorted by tier (local, replica, persistent), node, step.

    Raises:
        CliError: ``root`` is missing or not a directory.
    """
    store = open_root(root)
    base = store.root.rstrip("/")
    if parse_step(posixpath.basename(base)) is not None:
        store, name = _parent_store(store)
        rels = [name]
    else:
        rels = list(_walk_steps(store, "", 0, max_depth))
    out = []
    for rel in rels:
        parts = [p for p in store.path(rel).split("/") if p]
        tier, node, source = classify(parts)
        doc = manifest.read_committed(store, rel)
        if doc is not None and tier == "local" and isinstance(doc.get("node"), int):
            node = doc["node"]
        out.append(
            StepDir(
                store=store,
                rel=rel,
                tier=tier,
                step=parse_step(parts[-1]) or 0,  # _walk_steps yields step-<N> directories only
                node=node,
                source_node=source,
                manifest=doc,
                marker_present=doc is not None or store.exists(f"{rel}/{MARKER}"),
            )
        )
    out.sort(key=StepDir.sort_key)
    return out


# --------------------------------------------------------------------------------------------
# ls
# --------------------------------------------------------------------------------------------
def _committed_label(s: StepDir, lineage_id: str | None = None, abandoned: dict | None = None) -> str:
    if s.committed:
        if s.foreign(lineage_id):
            return "yes, other lineage"
        return "yes, abandoned" if abandoned and s.save[0] in abandoned else "yes"
    if s.store.exists(f"{s.rel}/{MARKER}.superseded"):
        return "no (superseded by a rollback)"
    return "no (bad marker)" if s.marker_present else "no"


_LINEAGE_ID = re.compile(r"^[0-9a-f]{32}$")


def resolve_lineage(value: str | None) -> str | None:
    """The lineage id ``ls --lineage`` compares against: ``value`` itself when it is a lineage
    id (32 hex digits), else the id recorded in the persistent root ``value``.

    Raises:
        CliError: ``value`` is neither an id nor a root holding a lineage file.
    """
    if value is None:
        return None
    if _LINEAGE_ID.match(value):
        return value
    store = open_root(value)
    try:
        lid = lineage.read(store)
    except (ConfigError, OSError) as e:
        raise CliError(f"--lineage: {e}") from None
    if lid is None:
        raise CliError(f"--lineage: {value!r} has no {LINEAGE}; pass the job's persistent root or a lineage "
                       "id (32 hex digits)")
    return lid


def cmd_ls(args: argparse.Namespace) -> int:
    """``tierckpt ls``: table (or JSON list) of every step directory under ``args.root``, with
    the save that wrote each committed copy (``save_id``, ``save_order``) and the copies of the
    newest save by agreed order marked (``newest``; ``*`` in the table) — what a restore without
    a step tries first, which is not the highest step number after a rollback or a fallback.
    Copies of saves that a later save found under the root proves abandoned (``abandoned``: the
    proving save id; "yes, abandoned" in the table) are never restored nor counted by retention,
    whatever their marker. With ``--lineage``, committed node-local steps and replicas of another
    lineage (which restore ignores and the next start deletes) are marked. ``kept_because``
    ("kept because" in the table): why the last retention pass kept each committed step
    (:mod:`tierckpt.cli.kept`; None / ``?``: not recorded)."""
    lineage_id = resolve_lineage(getattr(args, "lineage", None))
    steps = find_steps(args.root, args.max_depth)
    why = kept_because(steps)
    gone = abandoned_of(steps, lineage_id)
    newest, stale = newest_save(steps, lineage_id, gone)
    head = {id(x) for x in newest}
    rows: list[dict[str, Any]] = []
    for s in steps:
        files, nbytes = s.files_and_bytes()
        rows.append(
            {
                "tier": s.tier,
                "node": s.node,
                "source_node": s.source_node,
                "step": s.step,
                "committed": s.committed,
                "lineage": s.lineage,
                "foreign": s.foreign(lineage_id),
                "save_id": s.save[0] if s.committed else None,
                "save_order": list(s.save[1]) if s.committed and not is_legacy(*s.save) else None,
                "newest": id(s) in head,
                "abandoned": gone.get(s.save[0], "") if s.committed and s.save[0] in gone else None,
                "kept_because": why.get(id(s)),
                "files": files,
                "bytes": nbytes,
                "path": s.path,
            }
        )
    if args.json:
        _print_json(rows)
        return EXIT_OK
    table = Table(title=f"step directories under {args.root}")
    columns: tuple[tuple[str, dict[str, Any]], ...] = (
        ("tier", {}),
        ("node", {}),
        ("step", {"justify": "right"}),
        ("committed", {}),
        ("lineage", {}),
        ("save", {"justify": "right"}),
        ("kept because", {}),
        ("files", {"justify": "right"}),
        ("bytes", {"justify": "right"}),
        ("path", {"overflow": "fold"}),
    )
    for col, kw in columns:
        table.add_column(col, **kw)
    for s, r in zip(steps, rows):
        table.add_row(
            s.tier, s.node_label(), str(s.step), _committed_label(s, lineage_id, gone),
            (s.lineage or "-")[:8], s.save_label() + (" *" if id(s) in head else ""),
            kept_label(r["kept_because"], s.committed), str(r["files"]), human_bytes(r["bytes"]), str(r["path"]),
        )
    con = _stdout()
    con.print(table)
    _ls_summary(con, steps, lineage_id, newest, stale, gone)
    return EXIT_OK


def _ls_summary(con, steps: list[StepDir], lineage_id: str | None, newest: list[StepDir], stale: list[StepDir],
                gone: dict[str, str]) -> None:
    """The lines under ``ls``'s table: counts, the newest save, stale and abandoned copies."""
    n_c = sum(1 for s in steps if s.committed)
    n_f = sum(1 for s in steps if s.foreign(lineage_id))
    con.print(f"{len(steps)} step directories, {n_c} committed, {len(steps) - n_c} uncommitted"
              + (f"; {n_f} committed of another lineage (restore ignores them)" if lineage_id else ""))
    if newest:
        con.print(f"newest save (*): step {newest[0].step}, save {newest[0].save[0] or 'without identity'} — what a restore "
                  "without a step tries first (saves are ordered by save_order, not by step number)")
    if stale:
        con.print(f"{len(stale)} committed copies of higher steps belong to older saves (an abandoned timeline a "
                  f"rollback or fallback has not superseded yet): steps {sorted({x.step for x in stale})}")
    dead = [s for s in steps if s.committed and not s.foreign(lineage_id) and s.save[0] in gone]
    if dead:
        con.print(f"{len(dead)} committed copies belong to abandoned saves (a later save resumed an older one; never "
                  f"restored, not counted by retention): steps {sorted({x.step for x in dead})}, saves "
                  + ", ".join(f"{sid} (abandoned by {by})" for sid, by in sorted(gone.items())))


def abandoned_of(steps: list[StepDir], lineage_id: str | None = None) -> dict[str, str]:
    """{save id: the save id proving it abandoned} among the committed copies of ``steps``
    (:func:`tierckpt.history.timeline.abandoned_saves`; other lineages' node-local copies left
    out)."""
    saves: dict[str | None, tuple] = {}
    for s in steps:
        if s.committed and not s.foreign(lineage_id) and s.save[0] is not None:
            order, d = s.save[1], descent_of(s.manifest)
            if s.save[0] not in saves or (saves[s.save[0]][1] is None and d is not None):
                saves[s.save[0]] = (order, d)
    return {k: v or "" for k, v in abandoned_saves(saves).items()}


def newest_save(steps: list[StepDir], lineage_id: str | None = None,
                abandoned: dict | set | None = None) -> tuple[list[StepDir], list[StepDir]]:
    """(the committed copies of the newest save by agreed order (:func:`tierckpt.history.
    timeline.save_key`: not the highest step number) that is not ``abandoned``, the committed
    copies of higher steps that belong to older saves, not abandoned) among ``steps``, other
    lineages' node-local copies left out."""
    gone = abandoned or ()
    mine = [s for s in steps if s.committed and not s.foreign(lineage_id) and s.save[0] not in gone]
    if not mine:
        return [], []
    key = max(save_key(s.step, *s.save) for s in mine)
    newest = [s for s in mine if save_key(s.step, *s.save) == key]
    return newest, [s for s in mine if s.step > newest[0].step]


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------
UNCOMMITTED = "uncommitted (ignored by restore)"


def verify_one(s: StepDir) -> tuple[str, list[str]]:
    """Re-hash one step directory.

    Returns:
        ``(status, problems)``: status ``"OK"``, ``"CORRUPT"`` or :data:`UNCOMMITTED`.
        A commit marker that no longer matches its manifest counts as ``CORRUPT``: the step
        was committed and has since been damaged.
    """
    if not s.committed:
        if s.marker_present:
            return "CORRUPT", [f"{s.rel}: commit marker present but the manifest is missing, "
                               "unreadable or does not match the marker"]
        return UNCOMMITTED, []
    try:
        problems = manifest.verify_step(s.store, s.rel)
    except OSError as e:
        problems = [f"{s.rel}: unreadable ({e.__class__.__name__}: {e})"]
    return ("CORRUPT" if problems else "OK"), problems


def cmd_verify(args: argparse.Namespace) -> int:
    """``tierckpt verify``: re-hash every committed step; exit 1 if any is corrupt, 2 if the
    root holds no step directory at all (a wrong path must not pass an integrity gate)."""
    steps = find_steps(args.root, args.max_depth)
    if not steps:
        print(f"tierckpt: error: no step-<N> directory under {args.root} (wrong root?)", file=sys.stderr)
        return 2
    results = []
    for s in steps:
        status: Text | str
        status, problems = verify_one(s)
        results.append((s, status, problems))
    n_ok = sum(1 for _, st, _ in results if st == "OK")
    n_bad = sum(1 for _, st, _ in results if st == "CORRUPT")
    n_unc = sum(1 for _, st, _ in results if st == UNCOMMITTED)
    n_verified = n_ok + n_bad
    if args.json:
        _print_json(
            {
                "steps": [
                    {"path": s.path, "tier": s.tier, "node": s.node, "source_node": s.source_node,
                     "step": s.step, "committed": s.committed, "status": st, "problems": pr}
                    for s, st, pr in results
                ],
                "verified": n_verified,
                "corrupt": n_bad,
                "uncommitted": n_unc,
            }
        )
    else:
        table = Table(title=f"verification of {args.root}")
        table.add_column("path", overflow="fold")
        table.add_column("tier")
        table.add_column("step", justify="right")
        table.add_column("status", overflow="fold")
        for s, st, pr in results:
            if st == "CORRUPT":
                more = f" (+{len(pr) - 1} more)" if len(pr) > 1 else ""
                first = pr[0].removeprefix(f"{s.rel}/")  # the path column already names the step
                status = Text.assemble(("CORRUPT", "bold red"), f": {first}{more}")
            elif st == "OK":
                status = Text("OK", style="green")
            else:
                status = st
            table.add_row(s.path, s.tier, str(s.step), status)
        con = _stdout()
        con.print(table)
        con.print(f"{n_verified} steps verified, {n_bad} corrupt, {n_unc} uncommitted")
    return EXIT_CORRUPT if n_bad else EXIT_OK


# --------------------------------------------------------------------------------------------
# ledger
# --------------------------------------------------------------------------------------------
def cmd_ledger(args: argparse.Namespace) -> int:
    """``tierckpt ledger``: summary of the ledger of ``<root>`` (``tierckpt-ledger.jsonl`` and, on
    object stores, the record objects of ``tierckpt-ledger.d/``)."""
    store = open_root(args.root)
    if not Ledger.exists(store):
        raise CliError(f"no ledger at {store.url_of(LEDGER)} (pass the persistent root)")
    records = Ledger.read_records(store)
    summary = summarize(records)
    if args.json:
        _print_json(summary)
        return EXIT_OK
    con = _stdout()

    runs = Table(title="runs")
    for col in ("run", "start", "end", "clean"):
        runs.add_column(col)
    for col in ("exposure s", "restart", "checkpoints", "restores"):
        runs.add_column(col, justify="right")
    for r in summary["runs"]:
        runs.add_row(
            _short(r["run_id"]),
            _fmt_time(r["start"]),
            _fmt_time(r["end"]),
            "clean" if r["clean"] is True else Text("no clean end", style="red"),
            _fmt_seconds(r["exposure_s"]),
            "-" if r.get("restart_count") is None else str(r["restart_count"]),
            str(r["checkpoints"]),
            str(r["restores"]),
        )
    con.print(runs)

    tiers = Table(title="checkpoints per tier")
    tiers.add_column("tier")
    for col in ("count", "ok", "failed", "deferred", "mean blocking s", "mean background s", "last step",
                "last bytes"):
        tiers.add_column(col, justify="right")
    for name in sorted(summary["checkpoints"], key=lambda t: (TIER_ORDER.get(t, 9), t)):
        t = summary["checkpoints"][name]
        tiers.add_row(
            name, str(t["count"]), str(t["ok"]), str(t["failed"]), str(t.get("deferred", 0)),
            _fmt_seconds(t["mean_blocking_s"]), _fmt_seconds(t["mean_background_s"]),
            "-" if t["last_step"] is None else str(t["last_step"]),
            human_bytes(t["last_bytes"]) if t["ok"] else "-",
        )
    con.print(tiers)

    rest = Table(title="restores")
    rest.add_column("time")
    rest.add_column("step", justify="right")
    rest.add_column("sources", overflow="fold")
    for col in ("bytes", "seconds", "attempts", "persistent bytes"):
        rest.add_column(col, justify="right")
    for r in records:
        if isinstance(r, RestoreRecord):
            rest.add_row(
                _fmt_time(r.time),
                "-" if r.step is None else str(r.step),
                _fmt_sources(r.sources),
                human_bytes(r.bytes),
                _fmt_seconds(r.seconds),
                "-" if r.attempts is None else str(r.attempts),
                human_bytes(r.persistent_bytes),
            )
    con.print(rest)
    for r in records:  # each restart's phases (tierckpt/recovery/timeline.py)
        if isinstance(r, RecoveryRecord):
            con.print(recovery_view(r))
    con.print(f"runs: {len(summary['runs'])}, failures (no clean end): {len(summary['failures'])}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------
def _add_root_and_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", help="local path or fsspec URL (s3://bucket/run, memory://x)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--storage-options", type=storage_options_arg, default=None, metavar="JSON",
                   help="fsspec options of URL roots, a JSON object (e.g. '{\"endpoint_url\": \"http://s3.local:9000\"}'); "
                        "default: none, s3fs reads AWS_* from the environment")


def storage_options_arg(text: str) -> dict:
    """argparse ``type=`` of ``--storage-options``: a JSON object (:func:`tierckpt.cli.main`
    registers it for every URL the command opens, :func:`tierckpt.io.storage.register_options`).

    Raises:
        argparse.ArgumentTypeError: not a JSON object (exit 2).
    """
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _register_ls(subparsers) -> None:
    p = subparsers.add_parser(
        "ls", help="list step directories of every tier under a root",
        description="List every step-<N> directory under ROOT (local, replica and persistent "
        "tiers), with its node, commit state, file count and size.",
    )
    _add_root_and_json(p)
    p.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH,
                   help=f"directory levels searched below ROOT (default {DEFAULT_MAX_DEPTH})")
    p.add_argument("--lineage", metavar="ROOT|ID", default=None,
                   help=f"the job's persistent root (its {LINEAGE}) or lineage id: mark committed node-local "
                        "steps and replicas of another lineage, which restore ignores")
    p.set_defaults(func=cmd_ls)


def _register_verify(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="re-hash every committed step; exit 1 if any is corrupt",
        description="Re-check size and xxh3-64 of every file of every committed step under "
        "ROOT. Uncommitted steps are listed and ignored (restore ignores them too). Exit 1 if "
        "any committed step is corrupt.",
    )
    _add_root_and_json(p)
    p.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH,
                   help=f"directory levels searched below ROOT (default {DEFAULT_MAX_DEPTH})")
    p.set_defaults(func=cmd_verify)


def _register_ledger(subparsers) -> None:
    p = subparsers.add_parser(
        "ledger", help="summarise the ledger of a persistent root",
        description=f"Summarise ROOT/{LEDGER} (and ROOT/{LEDGER_DIR}/ on object stores): runs and failures, checkpoints per tier, restores, and each "
        "recovery's phases (failure noticed → first step after the restore).",
    )
    _add_root_and_json(p)
    p.set_defaults(func=cmd_ledger)
