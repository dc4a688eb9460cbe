"""Invariants of the fault campaign (:mod:`bench.fault_campaign`), computed from the files on disk.

Nothing here asks the restore planner what it would do: the step directories are listed, their
manifests and markers read (:func:`tierckpt.io.manifest.read_committed`) and every file re-hashed
(:func:`tierckpt.io.manifest.verify_files`) by the campaign itself, and the expected outcome of a
restore is derived from that listing alone.

Definitions (one function each, pure where possible so that tests can feed them wrong data):

- a **copy** is one ``step-<N>`` directory: a node-local one (``local/`` or ``replicas/node-m/``
  of a surviving node's root; its saved node is the one its manifest names) or a persistent one;
  it is **committed** when its marker matches its manifest, **intact** when it is committed, its
  manifest lists exactly the data files present (``.metadata`` included) and every size and
  checksum matches;
- a copy's **save** is the ``save_id`` its manifest records (``None`` for a copy written before
  save identities; :mod:`tierckpt.history.timeline`), ordered by the manifest's ``save_order``
  (:func:`tierckpt.history.timeline.save_key`: not by step number; copies without identity by
  step, before every identified save);
- a save is **abandoned** (:func:`abandoned_saves`) when a later save, itself not abandoned,
  records (``descends_from``) that its run resumed an older save: every save ordered strictly
  between that parent and the run's first save (``since``) was passed over;
- :func:`expected_save` / :func:`expected_step`: the newest (step, save) in that order, not
  abandoned, for which
  every node of the job has an intact copy of its state written by that same save and saved by
  a job of the same shape (any holder), or an intact persistent step of that save (unless the
  restore may not read the persistent tier); None when none qualifies;
- :func:`check_one_save`: every restore (each ledger ``restore`` record) combines copies of one
  save: the copy each node was served from (own-local / peer-replica: the holder's copies of the
  node's state and the node's pulled ``local/step-N``; persistent: ``pfs/step-N``; in-cluster:
  some node-local copy of each node) records the record's ``save_id``;
- :func:`check_restored`: every rank restored the expected step with its state bitwise equal to
  the saved snapshot; with no expected step, a fresh start only when nothing is committed at all,
  otherwise NoCheckpointError;
- :func:`check_visible`: every step ``tierckpt ls`` reports committed is intact, and
  ``tierckpt verify`` reports nothing corrupt;
- :func:`check_no_loss`: per (saved node, step) the count of committed node-local copies — and per
  step the committed persistent copy — does not drop, except what retention may purge: a
  node-local copy of node n's step s when at least ``keep_local`` newer steps of node n are
  committed afterwards, a persistent step when at least ``keep_persistent`` newer persistent
  steps are (newer: of newer saves, in save order, not abandoned); retention only counts when a
  save ran in between (``allow_retention``); copies of abandoned saves may go (superseded);
- :func:`check_redundancy`: after a restore served only from node-local copies, every node's
  restored step has ``factor`` copies on distinct nodes again;
- :func:`check_new_timeline`: a run that restored an older save (a fallback, a rollback) and saved
  again left one ``rollback`` record, no committed copy of the timeline it abandoned, nothing
  else lost but to retention, its last save as the newest complete one, and a ``durable_step``
  that is its newest persistent step and exists;
- the ledger checks (:func:`check_ledger_parse`, :func:`check_restore_record`,
  :func:`check_failure_records`);
- :func:`check_per_rank_files` (``per-rank-values`` trials), **every rank gets its own values**
  as the files hold them: every intact copy holds each of its saving ranks' own
  :func:`per_rank_values` — a persistent step under each rank's qualified key
  (``__tierckpt_rank__/<rank>/…``; the plain key: rank 0's), a node-local step of a one-rank node
  under the plain key, of a node of several ranks under each of its ranks' qualified keys (the
  plain key: the node's lowest rank's); values equal on every rank are never written per rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections import Counter
from dataclasses import dataclass, field

from tierckpt.history.timeline import LEGACY_ORDER, of_manifest, run_of, save_key
from tierckpt.io import manifest
from tierckpt.io.layout import INPROGRESS, LEDGER, MANIFEST, MARKER, parse_node, parse_step
from tierckpt.io.storage import Store


# --------------------------------------------------------------------------------------------
# what is on disk
# --------------------------------------------------------------------------------------------
@dataclass
class Copy:
    """One step directory as the campaign sees it (see the module docstring)."""

    where: str                 # "node-<h>" (a node's local root) or "pfs"
    holder: int | None         # h for a node-local copy, None for persistent
    rel: str                   # path relative to its root
    step: int
    node: int | None           # the saved node its manifest names (None: persistent / uncommitted)
    committed: bool
    intact: bool
    nodes: int | None = None   # shape of the job that saved it, from the manifest
    world_size: int | None = None
    problems: list[str] = field(default_factory=list)
    save_id: str | None = None  # the save that wrote it (None: legacy or uncommitted)
    order: tuple[int, int] = LEGACY_ORDER  # its save_order
    descends_from: dict | None = None  # what its save's run had restored (the manifest's value)

    def __post_init__(self) -> None:
        self.order = tuple(self.order)  # type: ignore[assignment]  # a list once through JSON

    @property
    def path(self) -> str:
        return f"{self.where}/{self.rel}"


def _data_files(d: str) -> set[str]:
    """Files of a step directory other than the commit files, the in-progress mark and leftovers."""
    out = set()
    for root, _, files in os.walk(d):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), d).replace(os.sep, "/")
            if rel in (MANIFEST, MARKER, INPROGRESS) or rel.endswith(".tmp") or rel.startswith(f"{MARKER}."):
                continue
            out.add(rel)
    return out


def inspect(store: Store, rel: str, where: str, holder: int | None, verify: bool = True) -> Copy:
    """Read one step directory's commit state and (``verify``) re-hash every file."""
    step = parse_step(rel.rsplit("/", 1)[-1])
    assert step is not None
    doc = manifest.read_committed(store, rel)
    if doc is None:
        return Copy(where, holder, rel, step, None, False, False)
    problems: list[str] = []
    if verify:
        entries = manifest.entries_of(doc)
        listed = {e.path for e in entries}
        present = _data_files(store.path(rel))
        if listed != present:
            problems.append(f"manifest lists {sorted(listed - present)} missing, "
                            f"{sorted(present - listed)} unlisted")
        if ".metadata" not in listed:
            problems.append("no .metadata in the manifest")
        problems += manifest.verify_files(store, rel, entries)

    def num(k):
        v = doc.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    node = num("node") if holder is not None else None
    sid, order = of_manifest(doc)
    d = doc.get("descends_from")
    return Copy(where, holder, rel, step, node, True, not problems, num("nodes"), num("world_size"), problems,
                sid, order, d if isinstance(d, dict) else None)


def scan_disk(base: str, verify: bool = True) -> list[Copy]:
    """Every step directory under ``<base>/nvme/node-<h>/`` and ``<base>/pfs/``."""
    out: list[Copy] = []
    nvme = os.path.join(base, "nvme")
    for name in sorted(os.listdir(nvme)) if os.path.isdir(nvme) else []:
        h = parse_node(name)
        if h is None:
            continue
        store = Store(os.path.join(nvme, name))
        parents = ["local"] + [f"replicas/{m}" for m in store.listdir("replicas") if parse_node(m) is not None]
        for parent in parents:
            for sname in store.listdir(parent):
                if parse_step(sname) is not None and store.isdir(f"{parent}/{sname}"):
                    out.append(inspect(store, f"{parent}/{sname}", name, h, verify))
    pstore = Store(os.path.join(base, "pfs"))
    for sname in pstore.listdir(""):
        if parse_step(sname) is not None and pstore.isdir(sname):
            out.append(inspect(pstore, sname, "pfs", None, verify))
    return out


def copies_from_json(rows: list[dict]) -> list[Copy]:
    """:class:`Copy` objects back from their JSON form (the pre-fault snapshot file)."""
    return [Copy(**r) for r in rows]


# --------------------------------------------------------------------------------------------
# the restored step
# --------------------------------------------------------------------------------------------
def abandoned_saves(copies: list[Copy]) -> dict[str, str]:
    """{save id: the save proving it abandoned} among the committed ``copies`` (see the module
    docstring): saves walked newest first by ``save_order``; one whose order lies strictly between
    a walked, not abandoned save's ``descends_from`` ``save_order`` and ``since`` is abandoned.
    (The campaign's own reading of the manifests, not the engine's.)"""
    saves: dict[str, tuple[tuple[int, int], dict | None]] = {}
    for c in copies:
        if c.committed and c.save_id is not None and tuple(c.order) != LEGACY_ORDER:
            if c.save_id not in saves or (saves[c.save_id][1] is None and c.descends_from):
                saves[c.save_id] = ((c.order[0], c.order[1]), c.descends_from)
    out: dict[str, str] = {}
    live: list[tuple[str, tuple, tuple]] = []
    for sid in sorted(saves, key=lambda x: (saves[x][0], x), reverse=True):
        order, d = saves[sid]
        by = next((p for p, lo, hi in live if lo < order < hi), None)
        if by is not None:
            out[sid] = by
        elif d:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                live.append((sid, tuple(int(x) for x in d["save_order"]), tuple(int(x) for x in d["since"])))
    return out


def expected_save(copies: list[Copy], nodes: int, step: int | None = None, *, world: int | None = None,
                  persistent: bool = True) -> tuple[int, str | None] | None:
    """Newest (step, save) every node of a ``nodes``-node job (``world`` ranks; default one per
    node) can be served from with copies of that one save: an intact copy of each node's state
    written by the save and saved by a job of that shape, on any surviving disk, or (unless not
    ``persistent``: a restore that may not read that tier) an intact persistent step of the save.
    Saves newest first by ``save_order`` (:func:`tierckpt.history.timeline.save_key`, not by
    step number), abandoned saves (:func:`abandoned_saves`) never; only ``step`` when given. None
    when nothing qualifies."""
    world = nodes if world is None else world
    gone = abandoned_saves(copies)
    saves: dict[tuple[int, str | None], tuple] = {}
    for c in copies:
        if c.intact and (step is None or c.step == step) and c.save_id not in gone:
            key = save_key(c.step, c.save_id, c.order)
            saves[(c.step, c.save_id)] = max(saves.get((c.step, c.save_id), key), key)
    for s, sid in sorted(saves, key=lambda x: saves[x], reverse=True):
        mine = [c for c in copies if c.intact and c.step == s and c.save_id == sid]
        if persistent and any(c.holder is None for c in mine):
            return s, sid
        if all(any(c.holder is not None and c.node == n and c.nodes == nodes and c.world_size == world
                   for c in mine) for n in range(nodes)):
            return s, sid
    return None


def expected_step(copies: list[Copy], nodes: int, world: int | None = None) -> int | None:
    """The step of :func:`expected_save` (None when no save qualifies)."""
    got = expected_save(copies, nodes, world=world)
    return None if got is None else got[0]


def any_committed(copies: list[Copy]) -> bool:
    """Whether any step directory is committed (the engine then must not start fresh)."""
    return any(c.committed for c in copies)


def check_restored(expected: int | None, committed_exists: bool, results: dict[int, dict]) -> list[str]:
    """Compare every rank's restore result (``step``, ``error``, ``mismatch``) with the
    expectation; returns violation texts."""
    out = []
    if expected is None:
        for r, v in sorted(results.items()):
            err = v.get("error")
            if committed_exists:
                if not (err or "").startswith("NoCheckpointError"):
                    got = f"raised {err[:300]}" if err else f"restored {v.get('step')}" if v.get("step") is not None \
                        else "started fresh"
                    out.append(f"rank {r}: no step is complete on every node, so NoCheckpointError was expected; "
                               f"the restore {got}")
            elif err or v.get("step") is not None:
                out.append(f"rank {r}: nothing committed anywhere, a fresh start was expected; the restore "
                           f"{'raised ' + err[:300] if err else 'restored ' + str(v.get('step'))}")
        return out
    for r, v in sorted(results.items()):
        if v.get("error"):
            out.append(f"rank {r}: step {expected} is complete on disk, the restore raised {v['error'][:400]}")
        elif v.get("step") != expected:
            out.append(f"rank {r}: restored step {v.get('step')}, but the newest step complete on disk "
                       f"for every node is {expected}")
        elif v.get("mismatch"):
            out.append(f"rank {r}: restored state of step {expected} differs from the saved state: "
                       f"{v['mismatch'][:300]}")
    return out


def check_sources(sources: dict[str, list], step: int, before: list[Copy], save_id: str | None = None,
                  *, by_save: bool = False) -> list[str]:
    """Each node's reported source (own-local / peer-replica@h / persistent) held a committed
    copy of that node's ``step`` before the restore (``by_save``: one written by ``save_id``)."""
    if by_save:
        before = [c for c in before if c.save_id == save_id]
    out = []
    for node, (kind, holder) in sorted(sources.items(), key=lambda kv: int(kv[0])):
        n = int(node)
        if kind == "persistent":
            ok = any(c.holder is None and c.step == step and c.committed for c in before)
        elif kind == "own-local":
            ok = any(c.holder == n and c.node == n and c.step == step and c.committed for c in before)
        elif kind == "peer-replica":
            ok = any(c.holder == holder and c.node == n and c.step == step and c.committed for c in before)
        else:  # in-cluster: some copy of the node's state anywhere
            ok = any(c.holder is not None and c.node == n and c.step == step and c.committed for c in before)
        if not ok:
            out.append(f"node {n} was reported restored from {kind}"
                       f"{'' if holder is None else '@' + str(holder)} at step {step}"
                       f"{f' (save {save_id})' if by_save else ''}, but no such committed copy was on disk "
                       "before the restore")
    return out


def served_copies(copies: list[Copy], step: int, node: int, kind: str, holder: int | None) -> list[Copy]:
    """The committed copies node ``node`` may have been served ``step`` from by a source of
    ``kind`` (and ``holder``), per the files: own-local: the node's ``local/step-N`` (or, on a
    remapped disk without one, its root's copies of the node's state); peer-replica: the
    holder's copies of the node's state and the node's pulled ``local/step-N`` once committed;
    persistent: ``pfs/step-N``; in-cluster: every node-local copy of the node's state."""
    mine = [c for c in copies if c.committed and c.step == step]
    if kind == "persistent":
        return [c for c in mine if c.holder is None]
    own = [c for c in mine if c.holder == node and c.node == node]
    if kind == "own-local":
        local = [c for c in own if c.rel.startswith("local/")]
        return local or own
    if kind == "peer-replica":
        return [c for c in mine if c.holder == holder and c.node == node] + \
            [c for c in own if c.rel.startswith("local/")]
    return [c for c in mine if c.holder is not None and c.node == node]


def check_one_save(record: dict, served: dict[str, list[list]], *, strict: bool) -> list[str]:
    """A ledger ``restore`` record combined copies of one save: every node's served copies
    (``served``: {node: [[path, save_id], ...]} from :func:`served_copies`) record the record's
    ``save_id`` (a legacy ``None`` only when every copy records none). In-cluster: some copy of
    each node's state does. ``strict``: a node with no committed copy left to read is a
    violation (a restore-only run deletes nothing), else it is skipped (a later save's retention
    may have purged it)."""
    sid, step = record.get("save_id"), record.get("step")
    out = []
    for n, src in sorted((record.get("sources") or {}).items(), key=lambda kv: int(kv[0])):
        got = served.get(str(n), [])
        kind = src.get("source")
        if not got:
            if strict:
                out.append(f"one save: node {n} was restored step {step} from {kind}, but no committed copy of it "
                           "is on disk after the restore")
            continue
        wrong = [f"{path} (save {s})" for path, s in got if s != sid]
        if (kind == "in-cluster" and len(wrong) == len(got)) or (kind != "in-cluster" and wrong):
            out.append(f"one save: the restore of step {step} (save {sid}) served node {n} from {kind}, but the "
                       f"copy it reads records another save: {', '.join(wrong[:3])}")
    return out


def served_by_record(record: dict, copies: list[Copy], nodes: list[int] | None = None) -> dict[str, list[list]]:
    """{node: [[path, save_id]]} of the copies each node of ``record`` (a ``restore`` record)
    was served from (:func:`served_copies`); only ``nodes`` when given."""
    out: dict[str, list[list]] = {}
    step = record.get("step")
    if not isinstance(step, int):
        return out
    for n, src in (record.get("sources") or {}).items():
        if nodes is not None and int(n) not in nodes:
            continue
        got = served_copies(copies, step, int(n), src.get("source"), src.get("holder"))
        out[str(n)] = [[c.path, c.save_id] for c in got]
    return out


# --------------------------------------------------------------------------------------------
# visibility, loss, redundancy
# --------------------------------------------------------------------------------------------
def check_visible(ls_rows: list[dict], verify_doc: dict | None, copies: list[Copy], base: str) -> list[str]:
    """Every row ``tierckpt ls --json`` reports committed is an intact copy; ``tierckpt verify
    --json`` reports no corrupt step."""
    by_path = {os.path.normpath(os.path.join(base, "nvme" if c.holder is not None else "", c.path)): c
               for c in copies}
    out = []
    for row in ls_rows:
        if not row.get("committed"):
            continue
        c = by_path.get(os.path.normpath(str(row.get("path"))))
        if c is None or not c.intact:
            why = "it is not committed on disk" if c is None or not c.committed else "; ".join(c.problems[:3])
            out.append(f"tierckpt ls shows {row.get('path')} committed, but {why}")
    for st in (verify_doc or {}).get("steps", []):
        if st.get("status") == "CORRUPT":
            out.append(f"tierckpt verify: {st.get('path')} CORRUPT: {'; '.join(st.get('problems', [])[:2])}")
    return out


def run_cli(base: str) -> tuple[list[dict], dict | None, list[str]]:
    """``tierckpt ls --json`` and ``tierckpt verify --json`` of ``base`` through the CLI's own
    entry point; returns (ls rows, verify document, problems running them)."""
    from tierckpt.cli import main as cli_main

    problems = []
    docs = []
    for cmd in ("ls", "verify"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli_main([cmd, base, "--json"])
        try:
            docs.append(json.loads(buf.getvalue()) if buf.getvalue().strip() else None)
        except ValueError:
            docs.append(None)
            problems.append(f"tierckpt {cmd} --json printed no JSON (exit {rc})")
        if cmd == "verify" and rc not in (0, 2):  # 2: no step directory at all
            problems.append(f"tierckpt verify exited {rc}")
    return docs[0] or [], docs[1], problems


def copy_counts(copies: list[Copy]) -> Counter:
    """{(saved node, step): committed node-local copies} and {("pfs", step): 1}."""
    c: Counter = Counter()
    for x in copies:
        if not x.committed:
            continue
        if x.holder is None:
            c[("pfs", x.step)] = 1
        elif x.node is not None:
            c[(x.node, x.step)] += 1
    return c


def check_no_loss(before: list[Copy], after: list[Copy], *, keep_local: int, keep_persistent: int,
                  allow_retention: bool, lost_holders: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """Committed copies present ``before`` (on holders not in ``lost_holders``) still exist
    ``after``, counted per saved node and step (see the module docstring for retention)."""
    cb = copy_counts([c for c in before if c.holder is None or c.holder not in lost_holders])
    ca = copy_counts(after)
    gone = abandoned_saves([*before, *after])

    def who_of(c: Copy):
        return "pfs" if c.holder is None else c.node

    out = []
    for key, n in sorted(cb.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if ca[key] >= n:
            continue
        who, step = key
        if all(c.save_id in gone for c in before if c.committed and who_of(c) == who and c.step == step):
            continue  # copies of an abandoned save: not a resume point, superseded when seen
        if allow_retention:  # retention keeps the newest saves (save order, abandoned ones not counted)
            lost = max(save_key(c.step, c.save_id, c.order) for c in before
                       if c.committed and who_of(c) == who and c.step == step)
            newer = {c.step for c in after if c.committed and who_of(c) == who and c.save_id not in gone
                     and save_key(c.step, c.save_id, c.order) > lost}
            keep = keep_persistent if who == "pfs" else keep_local
            if keep and len(newer) >= keep:
                continue
        what = f"persistent step {step}" if who == "pfs" else f"node {who}'s step {step}"
        out.append(f"committed copy lost: {what} had {n} committed cop{'y' if n == 1 else 'ies'} before, "
                   f"{ca[key]} after")
    return out


def check_redundancy(after: list[Copy], step: int, nodes: int, factor: int) -> list[str]:
    """After a restore from node-local copies, each node's ``step`` is held intact by
    ``factor`` distinct nodes again."""
    out = []
    for n in range(nodes):
        holders = {c.holder for c in after if c.holder is not None and c.node == n and c.step == step and c.intact}
        if len(holders) < factor:
            out.append(f"redundancy not re-established after the restore: node {n}'s step {step} is held by "
                       f"{len(holders)} of F={factor} nodes ({sorted(holders)})")
    return out


# --------------------------------------------------------------------------------------------
# the ledger
# --------------------------------------------------------------------------------------------
def ledger_raw(base: str) -> list[bytes]:
    """The ledger's lines, raw (a torn last line included)."""
    try:
        with open(os.path.join(base, "pfs", LEDGER), "rb") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def ledger_lines(base: str) -> int:
    """How many lines the ledger has now (the records a phase appends start at this index)."""
    return len(ledger_raw(base))


def ledger_records(base: str, start: int = 0) -> list[dict]:
    """Parseable records from line ``start`` on."""
    out = []
    for raw in ledger_raw(base)[start:]:
        with contextlib.suppress(ValueError):
            rec = json.loads(raw)
            if isinstance(rec, dict) and "kind" in rec:
                out.append(rec)
    return out


def check_ledger_parse(raw: list[bytes], torn_injected: int) -> list[str]:
    """At most ``torn_injected`` unparseable lines, and none of them is followed on the same
    line by a record (a torn line must be terminated before the next append)."""
    bad = [i for i, line in enumerate(raw) if line.strip() and not _parses(line)]
    out = []
    if len(bad) > torn_injected:
        out.append(f"ledger: {len(bad)} unparseable lines, {torn_injected} torn by the campaign: lines "
                   f"{[i + 1 for i in bad][:5]}")
    for i in bad:
        if b'{"kind"' in raw[i][1:]:
            out.append(f"ledger line {i + 1}: a record was appended onto a torn line (it is lost to readers)")
    return out


def _parses(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def check_restore_record(records: list[dict], step: int, sources: dict[str, list]) -> list[str]:
    """Exactly one ``restore`` record among ``records`` (a restore phase's new lines), naming
    ``step`` and each node's source kind and holder."""
    recs = [r for r in records if r.get("kind") == "restore"]
    if len(recs) != 1:
        return [f"ledger: {len(recs)} restore records for one restore (expected 1)"]
    r = recs[0]
    out = []
    if r.get("step") != step:
        out.append(f"ledger: restore record says step {r.get('step')}, the restore loaded {step}")
    got = {str(n): [v.get("source"), v.get("holder")] for n, v in (r.get("sources") or {}).items()}
    want = {str(n): list(v) for n, v in sources.items()}
    if got != want:
        out.append(f"ledger: restore record sources {got} != the restore's {want}")
    return out


def check_failure_records(records: list[dict], tier: str, steps: list[int], *, skipped_node: int | None = None
                          ) -> list[str]:
    """One failed ``checkpoint`` record of ``tier`` per step in ``steps`` (an injected storage
    fault); with ``skipped_node``, at least one skipped local record naming that node stuck."""
    out = []
    if skipped_node is not None:
        sk = [r for r in records if r.get("kind") == "checkpoint" and r.get("tier") == "local" and r.get("skipped")]
        if not any(skipped_node in (r.get("stuck_nodes") or []) for r in sk):
            out.append(f"ledger: no skipped local checkpoint record names node {skipped_node} stuck "
                       f"(skipped records: {[(r.get('step'), r.get('stuck_nodes')) for r in sk]})")
        return out
    for s in steps:
        recs = [r for r in records if r.get("kind") == "checkpoint" and r.get("tier") == tier and r.get("step") == s]
        failed = [r for r in recs if not r.get("ok", True)]
        if len(failed) != 1 or len(recs) != 1:
            out.append(f"ledger: {tier} step {s} hit an injected storage fault: expected exactly one failed "
                       f"checkpoint record, found {len(failed)} failed of {len(recs)} "
                       f"({[(r.get('ok'), (r.get('error') or '')[:80]) for r in recs]})")
    return out


def check_ok_records_on_disk(records: list[dict], after: list[Copy], keep_persistent: int) -> list[str]:
    """Every persistent ``checkpoint`` record with ``ok`` names a step committed in the
    persistent root now, or one retention may have purged since (``keep_persistent`` newer)."""
    pfs = {c.step for c in after if c.holder is None and c.committed}
    out = []
    for r in records:
        if r.get("kind") == "checkpoint" and r.get("tier") == "persistent" and r.get("ok"):
            s = r.get("step")
            if s is not None and s not in pfs and len({x for x in pfs if x > s}) < keep_persistent:
                out.append(f"ledger: persistent step {s} recorded ok, but it is not committed in the persistent root")
    return out


# --------------------------------------------------------------------------------------------
# per-rank values under one key (fault point "per-rank-values")
# --------------------------------------------------------------------------------------------
PER_RANK_KEYS = ("probe", "rng", "counter", "obj.rank", "obj.step")
"""The flattened keys of :func:`per_rank_values` under the state's ``per_rank`` key."""


def per_rank_values(rank: int, step: int) -> dict:
    """Rank ``rank``'s values at ``step``, the same keys on every rank: a plain tensor, a CPU RNG
    state (of a generator seeded ``1000·step + rank``, so the trainer's RNG is untouched), an
    int counter and an object."""
    import torch

    g = torch.Generator()
    g.manual_seed(1000 * step + rank)
    return {"probe": torch.full((4,), 100.0 + rank + 1000.0 * step), "rng": g.get_state(),
            "counter": 10 * step + rank, "obj": {"rank": rank, "step": step}}


def per_rank_template() -> dict:
    """A ``per_rank`` value to restore into: same structure, no saved value."""
    import torch

    return {"probe": torch.full((4,), -1.0), "rng": torch.zeros_like(torch.Generator().get_state()),
            "counter": -1, "obj": {"rank": -1, "step": -1}}


def _flat_values(rank: int, step: int) -> dict:
    v = per_rank_values(rank, step)
    return {"probe": v["probe"], "rng": v["rng"], "counter": v["counter"], "obj.rank": v["obj"]["rank"],
            "obj.step": v["obj"]["step"]}


def _load_keys(path: str, keys: dict[str, str]) -> dict:
    """{name: value} of DCP checkpoint ``path``'s items ``{name: DCP key}`` (stock DCP, one
    process; each name ends in its :data:`PER_RANK_KEYS` key)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    tmpl = per_rank_template()
    sd = {key: tmpl[name.rsplit("/", 1)[-1]].clone() if name.rsplit("/", 1)[-1] in ("probe", "rng") else ""
          for name, key in keys.items()}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return {name: sd[key] for name, key in keys.items()}


def _same(values: list) -> bool:
    """Whether ``values`` are all bitwise equal."""
    from tests.scenarios import assert_bitwise

    try:
        for v in values[1:]:
            assert_bitwise(v, values[0])
    except AssertionError:
        return False
    return True


def _qualified_keys(path: str, keys: set[str]) -> list[str]:
    """The rank-qualified entries of ``per_rank.<k>`` for ``k`` in ``keys`` in checkpoint ``path``."""
    from torch.distributed.checkpoint import FileSystemReader

    from tierckpt.io.per_rank import unqualify

    md = FileSystemReader(path).read_metadata()
    return sorted(k for k in md.state_dict_metadata if k != unqualify(k) and unqualify(k)[len("per_rank."):] in keys)


def check_per_rank_files(copies: list[Copy], base: str) -> list[str]:
    """Every intact copy holds its saving ranks' own :func:`per_rank_values` (see the module
    docstring; one or more ranks per node, from the copy's recorded shape). Returns violation
    texts."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tests.scenarios import assert_bitwise
    from tierckpt.io.per_rank import qualified

    out = []
    for c in copies:
        if not c.intact:
            continue
        root = os.path.join(base, "pfs") if c.where == "pfs" else os.path.join(base, "nvme", c.where)
        path = os.path.join(root, c.rel)
        if c.where == "pfs":
            ranks = range(c.world_size or 0)
            differ = [k for k in PER_RANK_KEYS if not _same([_flat_values(r, c.step)[k] for r in ranks])]
            owners = {f"{r}/{k}": qualified(r, f"per_rank.{k}") for r in ranks for k in differ}
            owners.update({f"plain/{k}": f"per_rank.{k}" for k in PER_RANK_KEYS})
            extra = _qualified_keys(path, set(PER_RANK_KEYS) - set(differ))
            if extra:
                out.append(f"{c.path}: values equal on every rank were written per rank too: {extra[:4]}")
        elif c.node is not None:
            rpn = (c.world_size or 1) // (c.nodes or 1) if c.world_size and c.nodes else 1
            ranks = range(c.node * rpn, (c.node + 1) * rpn)
            if rpn == 1:  # nothing differs inside a node of one rank: its value under the plain key
                owners = {f"{c.node}/{k}": f"per_rank.{k}" for k in PER_RANK_KEYS}
            else:  # a node of several ranks: each one's under its qualified key, the lowest's plain
                differ = [k for k in PER_RANK_KEYS if not _same([_flat_values(r, c.step)[k] for r in ranks])]
                owners = {f"{r}/{k}": qualified(r, f"per_rank.{k}") for r in ranks for k in differ}
                owners.update({f"{ranks[0]}/plain/{k}": f"per_rank.{k}" for k in PER_RANK_KEYS})
        else:
            continue
        try:
            got = _load_keys(path, owners)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a key missing from the files is the violation
            out.append(f"{c.path}: per-rank values not all readable: {type(e).__name__}: {str(e)[:300]}")
            continue
        for name, value in got.items():
            who, k = name.split("/", 1)
            if k.startswith("plain/"):  # a node's plain copy: its lowest rank's value
                k = k[len("plain/"):]
            rank = 0 if who == "plain" else int(who)
            want = _flat_values(rank, c.step)[k]
            try:
                assert_bitwise(value, want, f"{c.path}: {name}")
            except AssertionError as e:
                out.append(f"{c.path}: {'the plain copy is not rank 0' if who == 'plain' else 'rank ' + who}'s "
                           f"value of per_rank.{k}: {str(e)[:200]}")
    return out


# a new timeline (a fallback or a rollback) over an old one's step numbers (issue 28)
# --------------------------------------------------------------------------------------------
def passed_over(c: Copy, to_step: int, keep: str | None, new_run: str | None,
                keep_order: tuple[int, int] = LEGACY_ORDER, abandoned: dict | set | frozenset = frozenset()) -> bool:
    """Whether copy ``c`` belongs to the timeline a run abandons when it restored save ``keep``
    (``keep_order``) of ``to_step`` and started a new timeline: a copy of a higher step, of a
    newer save (save order), another save's copy of ``to_step``, or a copy of a save already
    ``abandoned`` (:func:`abandoned_saves`), not written by the run itself (``new_run``)."""
    if c.save_id is not None and run_of(c.save_id) == new_run:
        return False
    if c.save_id in abandoned and c.save_id != keep:
        return True
    if c.step == to_step:
        return c.save_id != keep
    return c.step > to_step or save_key(c.step, c.save_id, c.order) > save_key(to_step, keep, keep_order)


def copy_label(c: Copy) -> str:
    """How a ``rollback`` record names copy ``c``: ``persistent/<s>``, ``local node-<holder>/<s>``
    or ``replica node-<src>@node-<holder>/<s>``."""
    if c.holder is None:
        return f"persistent/{c.step}"
    parts = c.rel.split("/")
    src = parse_node(parts[1]) if len(parts) > 2 and parts[0] == "replicas" else None
    return f"local node-{c.holder}/{c.step}" if src is None else f"replica node-{src}@node-{c.holder}/{c.step}"


def check_new_timeline(before: list[Copy], after: list[Copy], records: list[dict], *, nodes: int, to_step: int,
                       keep: str | None, saved: list[tuple[int, str, list[str]]], cause: str | None,
                       keep_local: int, keep_persistent: int, base: str | None = None) -> list[str]:
    """The run that restored save ``keep`` of ``to_step`` and then saved ``saved`` ([(step,
    save id, tiers)], in order; ``records``: its ledger lines) left the job right:

    - one ``rollback`` record to ``to_step`` with ``cause`` (``"fallback"``, or None for a
      rollback by name) once it committed, naming as ``superseded`` only abandoned copies
      (:func:`copy_label`), every one of them whose marker is renamed ``*.superseded`` under
      ``base`` now among them (a copy the run replaced with its own save of the step is not
      superseded), and none ``failed``;
    - every committed copy ``before`` it that the new timeline passed over
      (:func:`passed_over`) is no longer committed as that save's copy (superseded), and
      nothing else committed is lost but to retention (:func:`check_no_loss`);
    - the newest save complete on disk (:func:`expected_save`) is the run's last save: retention
      never left the job fewer restorable steps than the step it just committed;
    - its ``run_end`` ``durable_step`` is its newest persistent step (None without one), and
      that step is committed.
    """
    out: list[str] = []
    new_run = run_of(saved[0][1]) if saved else None
    if not saved:
        return [f"the new timeline from step {to_step} saved nothing"]
    rb = [r for r in records if r.get("kind") == "rollback"]
    if len(rb) != 1 or rb[0].get("to_step") != to_step or rb[0].get("cause") != cause:
        out.append(f"ledger: expected one rollback record to step {to_step} (cause {cause}), found "
                   f"{[(r.get('from_step'), r.get('to_step'), r.get('cause')) for r in rb]}")
    now = {c.path: c for c in after}
    keep_order = next((c.order for c in before if c.committed and c.save_id == keep and c.step == to_step),
                      LEGACY_ORDER)
    gone = abandoned_saves(before)
    abandoned = [c for c in before if c.committed and passed_over(c, to_step, keep, new_run, keep_order, gone)]
    if len(rb) == 1:  # it names what was superseded: abandoned copies only, each one still marked so
        listed = set(rb[0].get("superseded") or [])
        allowed = {copy_label(c) for c in abandoned}
        marked = {copy_label(c) for c in abandoned if base is not None and os.path.exists(os.path.join(
            base, "pfs" if c.holder is None else os.path.join("nvme", c.where), c.rel, MARKER + ".superseded"))}
        if listed - allowed or marked - listed or rb[0].get("failed"):
            out.append(f"ledger: the rollback record names superseded {sorted(listed)} and failed "
                       f"{rb[0].get('failed') or []}; of the abandoned copies {sorted(allowed)}, {sorted(marked)} are "
                       "superseded on disk")
    for c in abandoned:
        a = now.get(c.path)
        if a is not None and a.committed and a.save_id == c.save_id:
            out.append(f"abandoned timeline: {c.path} (step {c.step}, save {c.save_id}) is still committed after the "
                       f"new timeline from step {to_step} (save {keep}) committed")
    kept = [c for c in before if not passed_over(c, to_step, keep, new_run, keep_order, gone)]
    out += check_no_loss(kept, after, keep_local=keep_local, keep_persistent=keep_persistent, allow_retention=True)
    last_step, last_sid, _ = saved[-1]
    got = expected_save(after, nodes)
    if got != (last_step, last_sid):
        out.append(f"retention/supersede: the new timeline's last save {last_sid} (step {last_step}) should be the "
                   f"newest save complete on disk, it is {got}")
    ends = [r for r in records if r.get("kind") == "run_end"]
    pers = [s for s, _, tiers in saved if "persistent" in tiers]
    if len(ends) != 1:
        out.append(f"ledger: {len(ends)} run_end records for the new timeline's run")
    else:
        durable = ends[0].get("durable_step")
        if durable != (pers[-1] if pers else None):  # the run's last persistent save (save order)
            out.append(f"ledger: run_end durable_step {durable}, the run's newest persistent step is "
                       f"{pers[-1] if pers else None}")
        if durable is not None and not any(c.holder is None and c.step == durable and c.committed for c in after):
            out.append(f"ledger: run_end durable_step {durable} is not committed in the persistent root")
    return out
