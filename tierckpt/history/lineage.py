"""Run lineage: which experiment a node-local step belongs to.

Node-local roots outlive jobs and are often shared by every experiment run from the same
configuration (``local_root`` rarely names the experiment), so a local step alone does not say
whose state it holds. The persistent root does: every run of one experiment — restarts,
requeues, new allocations — uses the same persistent root, and a new experiment uses another.

So each persistent root carries a lineage id, created once (``tierckpt-lineage.json``: a random
id, its creation time and the root's URL), and every committed step records the id it was made
under (``lineage`` in its manifest; replicas and pulled copies keep the source's manifest, so
they carry it too). A restore only offers local steps and replicas of the job's own lineage;
steps without one (written before lineages existed) count as another lineage. Deleting and
recreating the persistent root starts a new lineage.
"""

from __future__ import annotations

import json
import time
import uuid

from tierckpt.errors import ConfigError
from tierckpt.io.layout import LEDGER, LEDGER_DIR, LINEAGE
from tierckpt.io.storage import Store


def read(store: Store) -> str | None:
    """The lineage id recorded in the persistent root ``store``, or None when it has none yet.

    Raises:
        ConfigError: the file exists but holds no lineage id (option ``persistent_root``).
        OSError: the root cannot be read.
    """
    try:
        raw = store.read_bytes(LINEAGE)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        lid = doc["lineage"]
        if not isinstance(lid, str) or not lid:
            raise ValueError("empty lineage id")
    except (ValueError, KeyError, TypeError) as e:
        # Never replace it silently: a new id would make this experiment's local steps foreign,
        # and the next start would purge them.
        raise ConfigError("persistent_root", f"{store.url_of(LINEAGE)} is not a tierckpt lineage file ({e}); "
                          "restore it, or delete it to start a new lineage (node-local steps of the old "
                          "lineage are then purged; persistent steps stay)") from None
    return lid


def ensure(store: Store) -> tuple[str, bool, bool]:
    """The persistent root's lineage, creating it if absent (call on one rank only).

    Written atomically (:meth:`Store.write_atomic`) and read back, so a concurrent creator's
    id wins consistently. A lineage created over a root that already holds an experiment (a
    ledger: the run predates lineages) *adopts* node-local steps that record no lineage, so
    upgrading tierckpt never turns a running experiment's local steps foreign.

    Returns:
        ``(lineage id, created now, adopts unlabelled steps)``.
    Raises:
        ConfigError: the existing file is unreadable as a lineage file.
        OSError: the root cannot be read or written.
    """
    lid = read(store)
    if lid is not None:
        return lid, False, adopts_unlabelled(store)
    adopt = store.exists(LEDGER) or bool(store.listdir(LEDGER_DIR))  # a ledger (either layout)
    doc = {"format": "tierckpt-lineage", "lineage": uuid.uuid4().hex, "created": time.time(),
           "persistent_root": store.url, "adopts_unlabelled": adopt}
    store.write_atomic(LINEAGE, json.dumps(doc).encode())
    return str(read(store) or doc["lineage"]), True, adopts_unlabelled(store)


def adopts_unlabelled(store: Store) -> bool:
    """Whether the root's lineage owns node-local steps that record no lineage (see :func:`ensure`)."""
    try:
        return bool(json.loads(store.read_bytes(LINEAGE)).get("adopts_unlabelled"))
    except (OSError, ValueError, AttributeError):
        return False


def is_foreign(doc: dict | None, own: str | None, adopt_unlabelled: bool = False) -> bool:
    """Whether a committed step's manifest ``doc`` belongs to another lineage than ``own``
    (None: lineage not checked; a step without one is foreign unless ``adopt_unlabelled``)."""
    if own is None:
        return False
    lid = of_manifest(doc)
    return lid != own and not (lid is None and adopt_unlabelled)


def of_manifest(doc: dict | None) -> str | None:
    """The lineage id a committed step's manifest records (None: none, i.e. a legacy step)."""
    lid = doc.get("lineage") if isinstance(doc, dict) else None
    return lid if isinstance(lid, str) and lid else None


def label(lid: str | None) -> str:
    """A lineage id for log lines (``none`` for a step that records none)."""
    return lid or "none"
