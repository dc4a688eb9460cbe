"""Retention: keep the newest ``keep_latest_k`` committed steps of each tier.

"Newest" is the agreed save order (:func:`tierckpt.history.timeline.save_key`), not the step
number: after a rollback or a fallback, the new timeline's steps are newer than an abandoned
timeline's higher step numbers whose copies are still committed (a supersede that did not
happen yet, or failed), so retention never deletes the step a new timeline just committed in
favour of an abandoned (or corrupt) one. Copies without identity (written before save
identities) are the oldest, by step.

An *abandoned* save (:func:`tierckpt.history.timeline.abandoned_saves`: a later save, itself not
abandoned, resumed an older one) takes no slot of the k kept and is never protected, whether or
not its supersede happened: with keep 2, a node whose rename of an abandoned step 20 failed
keeps the new timeline's step and the step it started from, not 20. Its copy is not deleted
either (like a superseded one: the next start's restore supersedes it, ``cause: "leftover"``).
Which saves are abandoned is derived from every committed manifest of the root (each names what
its save descends from), plus what the caller knows (the restore's inventory, the saving run's
own descent).

Rules (a retention that deletes the step a restore is reading, or the only complete one, loses a
committed checkpoint):
- a step in ``in_use`` (being written or read right now) is never deleted;
- fewer than k committed steps are never left: only committed steps beyond the newest k
  are deleted;
- a ``protect``-ed step is kept beyond the newest k: the engine protects the newest step that
  every node committed (its local *anchor*), so a node whose saves keep failing cannot make the
  other nodes purge the last step the whole job could resume from without the persistent tier;
- uncommitted (torn) directories are deleted whatever their step — a torn step left by a full
  disk must not keep the disk full — but in the persistent root only those tierckpt started
  (marked ``tierckpt.inprogress``), never a framework's own folders (e.g. torchtitan's
  model-only export);
- in a node-local root, committed steps of another lineage (another experiment's, or written
  before lineages existed; :mod:`tierckpt.history.lineage`) never count towards the k kept; the purge at
  start deletes them like torn ones (retention after a save leaves them: restore ignores them
  anyway); steps of the job's own lineage are never deleted for being foreign;
- a step an explicit rollback superseded (``tierckpt.committed.superseded``) is not torn: it is
  kept until the new timeline writes the same step number again (the rollback can be undone
  by renaming the marker back and superseding the new timeline's steps, whose manifests
  otherwise still prove the old ones abandoned);
- deletion removes the commit marker first, so a half-deleted step is simply uncommitted.

Beyond the newest k, the persistent tier keeps the steps of its other rules (one per time
interval, one per N steps, every P steps and listed milestones; :mod:`tierckpt.tiers.keep`) and
the step the run restored from. Why each step is kept is recorded in the root's
``tierckpt-retention.json`` (:func:`write_record`; ``tierckpt ls`` shows it) before anything is
deleted, and the rules' picks recorded there keep their saves at every later pass, after a
restart or an option change too. A record that cannot be read keeps every committed step for
that pass (a pick it held is never lost to a damaged file), and is rewritten.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Iterable, Mapping

from tierckpt import clock
from tierckpt.history import lineage
from tierckpt.history.timeline import Descent, abandoned_saves, descent_of, of_manifest, save_key
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.tiers import keep

log = logging.getLogger(__name__)


class InUse:
    """Thread-safe registry of (tier, step-directory) pairs that retention must not touch."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def hold(self, key: str) -> None:
        """Protect ``key`` (reference counted) until the matching :meth:`drop`."""
        with self._lock:
            self._held[key] = self._held.get(key, 0) + 1

    def drop(self, key: str) -> None:
        """Release one :meth:`hold` of ``key``."""
        with self._lock:
            c = self._held.get(key, 0) - 1
            if c <= 0:
                self._held.pop(key, None)
            else:
                self._held[key] = c

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._held


def _docs(store: Store, parent: str) -> dict[int, dict | None]:
    """{step: committed manifest or None} of the ``step-<N>`` directories under ``parent``."""
    steps = sorted(s for s in (layout.parse_step(n) for n in store.listdir(parent)) if s is not None)
    return {s: manifest.read_committed(store, f"{parent}/{layout.step_name(s)}" if parent else layout.step_name(s))
            for s in steps}


def abandoned_in(docs: Iterable[dict | None], known: Iterable[str] = (), proofs: Iterable[Descent] = ()) -> set[str]:
    """The save ids abandoned among the saves of the committed manifests ``docs``
    (:func:`tierckpt.history.timeline.abandoned_saves`, ``proofs``: live descents, e.g. the
    saving run's own), plus ``known`` (abandoned by what the caller saw elsewhere)."""
    saves: dict[str | None, tuple] = {}
    for d in docs:
        if d is None:
            continue
        sid, order = of_manifest(d)
        if sid is not None and sid not in saves:
            saves[sid] = (order, descent_of(d))
    return set(abandoned_saves(saves, proofs)) | set(known)


Kept = dict[int, tuple[str | None, tuple[str, ...]]]
"""A decision: ``{step: (save_id, reasons)}`` of the steps kept (:func:`tierckpt.tiers.keep.decide`)."""


def committed_s_of(doc: dict | None) -> float | None:
    """The ``committed_s`` a manifest records (:func:`tierckpt.io.manifest.commit`), None: none."""
    v = doc.get("committed_s") if isinstance(doc, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def purge_dir(store: Store, parent: str, keep_k: int, in_use: InUse, key_prefix: str,
              only_marked_torn: bool = False, protect: Mapping[int, str] | frozenset | set = frozenset(),
              lineage_id: str | None = None, drop_foreign: bool = True,
              adopt_unlabelled: bool = False, drop_superseded: bool = False,
              abandoned: set[str] | frozenset[str] | None = None, proofs: Iterable[Descent] = (),
              docs: dict[int, dict | None] | None = None, policy: keep.Policy | None = None,
              picked: Kept | None = None, on_kept: Callable[[Kept], None] | None = None) -> list[int]:
    """Apply the rules to the ``step-<N>`` directories under ``parent`` of ``store``.

    Args:
        keep_k: committed steps to keep, the newest saves by agreed order (0 = keep every
            committed step; torn ones still go).
        key_prefix: prefix of the ``in_use`` keys of this directory (``key_prefix + step_rel``).
        only_marked_torn: delete only torn directories holding ``tierckpt.inprogress``.
        protect: committed steps kept in addition to the newest ``keep_k``: ``{step: reason}``,
            or a set of steps (reason ``local anchor``).
        lineage_id: the job's lineage; committed steps recording another one (or none) do not
            count as committed here. None: lineage is not checked.
        drop_foreign: delete those steps too (logged with their lineage).
        adopt_unlabelled: steps recording no lineage belong to ``lineage_id``.
        drop_superseded: delete steps a rollback superseded too (the purge at start of a local
            root: they would otherwise stay until the step number is written again).
        abandoned: save ids known abandoned (:func:`abandoned_in`); None: derived from this
            directory's manifests and ``proofs``. Their steps take no slot and are not
            protected, and are kept (not deleted).
        docs: this directory's manifests already read (:func:`_docs`), else read here.
        policy: the rules (:class:`tierckpt.tiers.keep.Policy`); None: the newest ``keep_k``.
        picked: an earlier decision, whose sticky picks keep their saves
            (:func:`tierckpt.tiers.keep.decide`).
        on_kept: called with the decision before anything is deleted (recording it).
    Returns:
        steps deleted.
    """
    docs = _docs(store, parent) if docs is None else docs
    steps = sorted(docs)
    rel = (lambda s: f"{parent}/{layout.step_name(s)}") if parent else layout.step_name
    foreign = {s: lineage.of_manifest(d) for s, d in docs.items()
               if d is not None and lineage.is_foreign(d, lineage_id, adopt_unlabelled)}
    dead = abandoned_in(docs.values(), proofs=proofs) if abandoned is None else abandoned
    left = {s for s in steps if docs[s] is not None and s not in foreign and of_manifest(docs[s])[0] in dead}
    if left:
        log.info("tierckpt retention: %s: steps %s belong to abandoned saves: not counted, kept until superseded",
                 store.url_of(parent), sorted(left))
    committed = [s for s in steps if docs[s] is not None and s not in foreign and s not in left]
    copies = [keep.Copy(s, sid, save_key(s, sid, order), committed_s_of(docs[s]))
              for s in committed for sid, order in (of_manifest(docs[s]),)]
    guard = dict(protect) if isinstance(protect, Mapping) else {s: keep.ANCHOR for s in protect}
    decided = keep.decide(copies, policy or keep.Policy(latest_k=keep_k), protect=guard, picked=picked)
    if on_kept is not None:
        on_kept({s: (of_manifest(docs[s])[0], why) for s, why in decided.items()})
    kept = set(decided)
    torn = [s for s in steps if docs[s] is None
            and (drop_superseded or not store.exists(f"{rel(s)}/{layout.MARKER}.superseded"))
            and (not only_marked_torn or store.exists(f"{rel(s)}/{layout.INPROGRESS}"))]
    doomed = sorted([s for s in committed if s not in kept] + torn + (list(foreign) if drop_foreign else []))
    deleted = []
    for s in doomed:
        r = rel(s)
        if key_prefix + r in in_use:
            continue
        try:
            manifest.uncommit(store, r)
            store.rmtree(r)
            deleted.append(s)
        except OSError as e:
            log.warning("tierckpt retention: could not delete %s: %s", store.url_of(r), e)
    gone = [s for s in deleted if s in foreign]
    if gone:
        log.warning("tierckpt: deleted node-local steps %s under %s: they belong to another lineage (%s), "
                    "not this job's (%s, from its persistent root)", gone, store.url_of(parent),
                    ", ".join(sorted({lineage.label(foreign[s]) for s in gone})), lineage.label(lineage_id))
    if len(gone) < len(deleted):
        log.info("tierckpt retention: deleted %s under %s (kept %s)", [s for s in deleted if s not in foreign],
                 store.url_of(parent), {s: ", ".join(why) for s, why in decided.items()})
    return deleted


def purge_local(store: Store, keep_k: int, in_use: InUse, protect: frozenset | set = frozenset(),
                lineage_id: str | None = None, drop_foreign: bool = True,
                adopt_unlabelled: bool = False, drop_superseded: bool = False,
                abandoned: Iterable[str] = (), proofs: Iterable[Descent] = (),
                record: bool = False) -> dict[str, list[int]]:
    """Retention of a node's local root: its own steps and every replica it holds; steps in
    ``protect`` are kept in each of them; steps of a lineage other than ``lineage_id`` are not
    counted, and deleted when ``drop_foreign``; abandoned saves (derived from every manifest of
    the root, ``proofs`` and ``abandoned``, see :func:`abandoned_in`) are not counted, not
    protected, not deleted (see the module docstring). ``record``: write why each step is kept
    to the root's ``tierckpt-retention.json`` (:func:`write_record`; the local rules pick
    nothing that must outlive a pass, so it is written after the deletions)."""
    parents = ["local"] + [f"replicas/{n}" for n in store.listdir("replicas") if layout.parse_node(n) is not None]
    docs = {p: _docs(store, p) for p in parents}
    mine = [d for p in parents for s, d in docs[p].items()
            if d is not None and not lineage.is_foreign(d, lineage_id, adopt_unlabelled)]
    gone = abandoned_in(mine, abandoned, proofs)
    decisions: dict[str, Kept] = {}

    def purge(parent: str) -> list[int]:
        return purge_dir(store, parent, keep_k, in_use, "local:", protect=protect, lineage_id=lineage_id,
                         drop_foreign=drop_foreign, adopt_unlabelled=adopt_unlabelled,
                         drop_superseded=drop_superseded, abandoned=gone, docs=docs[parent],
                         on_kept=lambda kept: decisions.__setitem__(parent, kept))

    out = {"local": purge("local")}
    for parent in parents[1:]:
        out[parent.split("/", 1)[1]] = purge(parent)
    if record:  # informational: the local rules pick nothing that must outlive a pass
        write_record(store, decisions, keep.Policy(latest_k=keep_k), durable=False)
    return out


def purge_incoming(store: Store) -> list[str]:
    """Delete a node root's leftover restore pulls (``local/.incoming-step-<N>``: a restore that
    died before moving its pull into place). Only at start, when no restore can be pulling.
    Returns the directories deleted."""
    gone = []
    for name in store.listdir("local"):
        if name.startswith(layout.INCOMING_PREFIX):
            rel = f"local/{name}"
            try:
                manifest.uncommit(store, rel)
                store.rmtree(rel)
                gone.append(rel)
            except OSError as e:
                log.warning("tierckpt: could not delete the leftover pull %s: %s", store.url_of(rel), e)
    return gone


def purge_persistent(store: Store, keep_k: int, in_use: InUse, abandoned: Iterable[str] = (),
                     proofs: Iterable[Descent] = (), *, policy: keep.Policy | None = None,
                     protect: Mapping[int, str] | None = None, record: bool = False) -> list[int]:
    """Retention of the persistent root (run by global rank 0 only); abandoned saves as in
    :func:`purge_local`. ``policy``: the rules (None: the newest ``keep_k``); ``protect``:
    ``{step: reason}`` kept too (the step the run restored from); ``record``: honour the picks
    of the root's ``tierckpt-retention.json`` and record this decision there before deleting
    (module docstring)."""
    docs = _docs(store, "")
    policy = policy or keep.Policy(latest_k=keep_k)
    picked: Kept | None = None
    if record:
        earlier = read_record(store)
        if earlier is None:  # damaged: keep every committed step this pass, never lose a pick
            log.warning("tierckpt retention: %s cannot be read; keeping every committed step this pass and "
                        "rewriting it", store.url_of(layout.RETENTION))
            policy = keep.Policy()
        picked = earlier.get("", {}) if earlier else {}

    def remember(kept: Kept) -> None:
        if record:
            write_record(store, {"": kept}, policy)

    return purge_dir(store, "", keep_k, in_use, "persistent:", only_marked_torn=True, protect=protect or {},
                     abandoned=abandoned_in(docs.values(), abandoned, proofs), docs=docs, policy=policy,
                     picked=picked, on_kept=remember)


# --------------------------------------------------------------------------------------------
# tierckpt-retention.json: why each step of a root is kept
# --------------------------------------------------------------------------------------------
RECORD_FORMAT = "tierckpt-retention"


def _step_rel(parent: str, step: int) -> str:
    return f"{parent}/{layout.step_name(step)}" if parent else layout.step_name(step)


def write_record(store: Store, decisions: Mapping[str, Kept], policy: keep.Policy, durable: bool = True) -> None:
    """Write ``tierckpt-retention.json`` at the root of ``store`` (atomically): ``{"format",
    "version", "updated_s" (UNIX seconds, :func:`tierckpt.clock.now`), "policy"
    (:meth:`tierckpt.tiers.keep.Policy.describe`), "kept": {step directory relative to the root:
    {"step", "save_id", "reasons"}}}`` for ``decisions`` (``{parent directory: decision}``).
    A failure is a warning: retention goes on (the next pass writes it again). ``durable=False``:
    not fsynced (a node root's record, which no later pass depends on)."""
    kept = {_step_rel(parent, s): {"step": s, "save_id": sid, "reasons": list(why)}
            for parent, d in decisions.items() for s, (sid, why) in sorted(d.items())}
    doc = {"format": RECORD_FORMAT, "version": 1, "updated_s": clock.now(), "policy": policy.describe(),
           "kept": kept}
    try:
        store.write_atomic(layout.RETENTION, json.dumps(doc, indent=1).encode(), sync=durable)
    except OSError as e:
        log.warning("tierckpt retention: could not record why steps are kept in %s: %s",
                    store.url_of(layout.RETENTION), e)


def read_record(store: Store, root: str = "") -> dict[str, Kept] | None:
    """The decisions recorded in the ``tierckpt-retention.json`` of the root ``root`` (relative
    to ``store``) as ``{parent directory ("" for the persistent root, ``local``,
    ``replicas/node-<n>``): {step: (save_id, reasons)}}``; ``{}`` when there is none; None when
    it exists but cannot be read or parsed."""
    rel = f"{root}/{layout.RETENTION}" if root else layout.RETENTION
    try:
        if not store.exists(rel):
            return {}
        doc = json.loads(store.read_bytes(rel))
        out: dict[str, Kept] = {}
        for rel, e in doc["kept"].items():
            parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
            sid = e.get("save_id")
            out.setdefault(parent, {})[int(e["step"])] = (sid if isinstance(sid, str) else None,
                                                          tuple(str(r) for r in e["reasons"]))
        if doc.get("format") != RECORD_FORMAT:
            return None
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
