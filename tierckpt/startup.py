"""The engine's start, step by step: open the node-local root, open the persistent root and its
lineage, agree that both work on every rank, check the persistent root is shared, and purge the
node-local steps of other experiments.

Each check fails with a :class:`~tierckpt.errors.ConfigError` naming the option, on every rank
(the outcome is all-gathered before anyone raises), so no rank is left waiting in a collective.
Every step on the node-local root (the purge, the probe, the generation survey) and the
generation's listing of the persistent root is bounded by ``TierConfig.restore_read_timeout_s``:
a root that stops answering is warned about and taken as holding nothing (:func:`_bounded_local`),
never a constructor that waits forever.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from dataclasses import dataclass

from tierckpt.config import TierConfig
import torch.distributed as dist

from tierckpt.cluster.collectives import broadcast_from_first, first_by_rank, gather_reduced
from tierckpt.cluster.topology import Groups, Topology, discover
from tierckpt.errors import ConfigError, ReadTimeout
from tierckpt.history import lineage
from tierckpt.history.journal import RunJournal
from tierckpt.history.ledger import Ledger
from tierckpt.history.timeline import Timeline
from tierckpt.io import layout, objstore, perms
from tierckpt.io.bounded import run_bounded
from tierckpt.io.perms import modes_of
from tierckpt.io.storage import Store, register_options
from tierckpt.tiers import ram, retention
from tierckpt.tiers.local_tier import LocalTier
from tierckpt.tiers.persistent import PersistentIO, PersistentTier

log = logging.getLogger(__name__)


def open_local_tier(cfg: TierConfig, topo: Topology, node_group, in_use: retention.InUse
                    ) -> tuple[LocalTier | None, ConfigError | None]:
    """The node's local tier (None when not configured) and this rank's problem with it.

    The node leader first removes torn steps and unfinished restore pulls of an earlier run
    (e.g. a full disk must not stay full) and sets tierckpt's directories there to
    ``local_permissions`` (:func:`tighten_local`); every rank then checks the root is writable
    (``local_root``), creating it with those modes."""
    if "local" not in cfg.tiers:
        return None, None
    root = cfg.local_root_for(topo.node, topo.hostname)
    store = Store(root, modes_of(cfg.local_permissions))
    bound = cfg.read_timeout_s
    if topo.is_node_leader:
        def clean() -> None:
            retention.purge_local(store, 0, in_use)
            retention.purge_incoming(store)

        try:
            _bounded_local(store, clean, bound, "cleaning torn steps")
        except ReadTimeout:
            pass  # warned; the node is taken as holding nothing local
        except OSError as e:
            log.warning("tierckpt: could not clean torn steps under %s: %s", root, e)
        _bounded_local(store, lambda: tighten_local(store), bound, "setting its modes", check=False)
    err = None
    if topo.is_node_leader and ram.is_ram_root(root):
        log.info("tierckpt: node %d: local_root %s is in host memory (tmpfs): it survives a process "
                 "restart, not a reboot; its footprint is checked at the first local save", topo.node, root)
    try:
        _bounded_local(store, lambda: _probe_writable(store), bound, "probing it")
    except ReadTimeout:
        pass  # a hung disk is not a configuration error: its saves fail (bounded) as tier failures
    except OSError as e:
        err = ConfigError("local_root", f"{root!r} (node {topo.node}) is not writable: {e}")
    return LocalTier(store, topo, node_group), err


_hung: weakref.WeakSet[Store] = weakref.WeakSet()  # local roots a start-up step found hung


def local_root_hung(store: Store) -> bool:
    """Whether a start-up step of this process found the node-local root ``store`` hung
    (:func:`_bounded_local`): the later start-up steps skip it."""
    return store in _hung


def _bounded_local(store: Store, fn, timeout_s: float, what: str, check: bool = True) -> None:
    """``fn()`` on the node-local root ``store``, bounded by ``timeout_s`` seconds
    (``TierConfig.restore_read_timeout_s``, :func:`tierckpt.io.bounded.run_bounded`): a root
    that stops answering (a hung NVMe or NFS mount, a FIFO in place of a manifest) must not
    hold the engine's constructor forever. On a timeout the root is marked hung (every later
    start-up step skips it at once, :func:`local_root_hung`), a warning says the node is taken
    as holding nothing local, and :class:`~tierckpt.errors.ReadTimeout` is raised when
    ``check`` (else swallowed); ``fn`` is left behind on its daemon thread. A root already
    marked hung raises (or returns) at once. Other errors of ``fn`` propagate."""
    if store in _hung:
        if check:
            raise ReadTimeout(f"{store.url}: found hung earlier in this start")
        return
    try:
        run_bounded(lambda progress: fn(), timeout_s, f"{what} of the node-local root {store.url}",
                    name="tierckpt-start")
    except ReadTimeout as e:
        _hung.add(store)
        log.warning("tierckpt: %s; this node is taken as holding nothing local (its saves to the local tier "
                    "fail as tier failures while it hangs; the persistent tier still restores it)", e)
        if check:
            raise


def tighten_local(store: Store) -> None:
    """Set ``local/``, ``replicas/`` and each ``replicas/node-<m>/`` of a node-local root to the
    store's directory mode when an earlier run (another ``local_permissions``, or a version
    that followed the umask) left them otherwise; what lies inside is then out of others'
    reach for ``"private"``. The root itself is left as it is when it already exists (an
    operator may have made it). Never raises: a failure is a warning."""
    if store.modes is None:
        return
    rels = ["local", "replicas"] + [f"replicas/{n}" for n in store.listdir("replicas")
                                    if layout.parse_node(n) is not None]
    for rel in rels:
        try:
            if perms.tighten(store.path(rel), store.modes.dir):
                log.info("tierckpt: %s set to mode %04o (local_permissions)", store.path(rel), store.modes.dir)
        except OSError as e:
            log.warning("tierckpt: could not set the mode of %s: %s", store.path(rel), e)


def open_persistent_root(cfg: TierConfig, rank: int) -> tuple[Store, tuple | None, ConfigError | None]:
    """The persistent root, its lineage ``(id, created, adopts_unlabelled)`` as read or created
    by global rank 0 (None on other ranks, :func:`tierckpt.history.lineage.ensure`), and this
    rank's problem with it (``persistent_root``: also a root that makes no progress for
    ``restore_read_timeout_s`` seconds)."""
    store = persistent_store(cfg)
    if rank != 0:
        return store, None, None

    def open_root(progress) -> tuple:
        objstore.check_root(store)  # creates a directory; a bucket must exist
        return lineage.ensure(store)

    try:
        # a shared file system that stops answering must not hold the constructor forever
        # (the other ranks would wait in the agreement until collective_timeout_s, then fail)
        return store, run_bounded(open_root, cfg.read_timeout_s, f"opening the persistent root {store.url}",
                                  name="tierckpt-start"), None
    except ReadTimeout as e:
        return store, None, ConfigError("persistent_root", f"{cfg.persistent_root!r} does not answer (a hung "
                                        f"shared file system?): {e}")
    except OSError as e:
        return store, None, ConfigError("persistent_root", f"{cfg.persistent_root!r} cannot be created: {e}")
    except ConfigError as e:
        return store, None, e


def persistent_store(cfg: TierConfig) -> Store:
    """The persistent root's :class:`Store`, with its ``storage_options`` (:meth:`TierConfig.options_for`)."""
    root = persistent_root(cfg)
    options = cfg.options_for(root)
    if options and "://" in root:
        register_options(root, options)  # for hooks handed a step's URL only
    return Store(root, **options)


def persistent_root(cfg: TierConfig) -> str:
    """``cfg.persistent_root`` (TierConfig refuses a config without one)."""
    if not cfg.persistent_root:
        raise ConfigError("persistent_root", "is required")
    return cfg.persistent_root


def raise_if_any_failed(err: ConfigError | None, group) -> None:
    """Raise on every rank when any rank had a start problem (collective over ``group``): the
    rank's own error, or the first rank's, named "failed on another rank"."""
    mine = [] if err is None else [(dist.get_rank(group), (err.option, str(err)))]
    errors = [e for _, e in gather_reduced(mine, group, first_by_rank(1))]
    if errors:
        raise err if err is not None else ConfigError(errors[0][0], f"failed on another rank: {errors[0][1]}")


def check_shared(store: Store, run_id: str, rank: int, group) -> None:
    """Rank 0 writes a probe into the persistent root; every rank must see it, or the
    "shared" storage is node-local and every persistent save would fail later (collective).
    A root rank 0 cannot write (read-only, full) is not judged: restoring from it still works,
    and its saves fail as tier failures.

    Raises:
        ConfigError: ``persistent_root`` is not visible from some rank.
    """
    probe = f".tierckpt-probe-{run_id}"
    wrote = False
    if rank == 0:
        try:
            store.write_atomic(probe, b"tierckpt shared-storage probe\n")
            wrote = True
        except OSError as e:  # read-only or full: restoring from it still works, saving will not
            log.warning("tierckpt: persistent_root %s is not writable (%s): restoring from it works, but its "
                        "saves will fail", store.url, e)
    wrote = broadcast_from_first(wrote, group)  # the probe exists (or not) before anyone looks
    try:
        seen = store.exists(probe) if wrote else True
    except OSError:
        seen = False
    blind = [r for r, _ in gather_reduced([] if seen else [(dist.get_rank(group), None)], group, first_by_rank(8))]
    if rank == 0 and wrote:
        try:
            store.remove(probe)
        except OSError as e:  # a root that turned read-only just now: a leftover probe is harmless
            log.warning("tierckpt: could not remove %s: %s", store.url_of(probe), e)
    if blind:
        raise ConfigError("persistent_root", f"{store.url!r} is not shared storage: ranks {blind} cannot "
                          "see a file rank 0 wrote there; use a shared filesystem or an fsspec URL")


def purge_other_lineages(local: LocalTier, topo: Topology, in_use: retention.InUse, lineage_id: str,
                         *, adopt: bool, created: bool, timeout_s: float = 60.0) -> None:
    """Label the local tier with the job's lineage and delete (node leader) the committed local
    steps and replicas of other lineages, and local copies a rollback superseded.

    Another experiment's steps are never offered (restore filters them) and are purged so they
    do not fill the disk, but never in the start that created the lineage: a persistent root
    that is new (or, by mistake, empty: an unmounted file system) must not cost the real
    experiment its node-local steps. ``timeout_s``: the purge's bound (:func:`_bounded_local`;
    a hung root is skipped with a warning)."""
    local.lineage, local.adopt_unlabelled = lineage_id, adopt
    if not topo.is_node_leader or created or local.store in _hung:
        return
    try:
        _bounded_local(local.store, lambda: retention.purge_local(
            local.store, 0, in_use, lineage_id=lineage_id, adopt_unlabelled=adopt, drop_superseded=True),
            timeout_s, "purging other lineages' steps")
    except ReadTimeout:
        pass  # warned
    except OSError as e:
        log.warning("tierckpt: could not purge node-local steps of other lineages under %s: %s", local.store.url, e)


def _probe_writable(store: Store) -> None:
    store.makedirs("")  # a root tierckpt creates gets local_permissions
    probe = f".tierckpt-probe-{os.getpid()}"
    with store.open(probe, "wb") as f:
        f.write(b"x")
    store.remove(probe)


def agree_generation(local: LocalTier | None, persistent, topo: Topology, group, timeout_s: float = 60.0) -> int:
    """The generation of this run's saves (:mod:`tierckpt.history.timeline`): one more than the
    highest generation any committed copy records — the node-local roots (each node leader lists
    its own) and the persistent tier (global rank 0) — the same on every rank (collective over
    ``group``, all ranks). A root that cannot be listed counts as holding nothing: its copies are
    then ordered by their own generation, which this run's saves may tie but never trail (a tie
    is broken by the save id, the same way on every rank).

    Each listing is bounded by ``timeout_s`` seconds (``TierConfig.restore_read_timeout_s``): a
    hung node-local root (:func:`_bounded_local`) or persistent root counts as holding nothing."""
    newest = -1
    if local is not None and topo.is_node_leader and local.store not in _hung:
        box: list[int] = []
        try:
            _bounded_local(local.store, lambda: box.append(max((c.order[0] for c in local.survey()[0]), default=-1)),
                           timeout_s, "listing the save generation")
            newest = box[0]
        except OSError as e:  # also ReadTimeout (warned)
            if not isinstance(e, ReadTimeout):
                log.warning("tierckpt: could not list %s for the save generation: %s", local.store.url, e)
    if topo.rank == 0 and persistent is not None:
        try:
            saves = persistent.committed_saves_bounded(timeout_s)
            newest = max([newest, *(order[0] for _, order in saves.values())])
        except (OSError, ValueError) as e:  # also ReadTimeout: a hung shared file system
            log.warning("tierckpt: could not list the persistent tier for the save generation: %s", e)
    return int(gather_reduced(newest, group, max)) + 1


@dataclass
class OpenedRun:
    """What :func:`open_run` opened (the same on every rank where agreed)."""

    topo: Topology
    groups: Groups
    local: LocalTier | None
    persistent: PersistentTier
    lineage: str
    timeline: Timeline
    ledger: Ledger
    journal: RunJournal
    in_use: retention.InUse


def open_run(cfg: TierConfig, node_id: int | None, persistent_io: PersistentIO | None) -> OpenedRun:
    """The engine's start (collective): topology and groups, the local root, the persistent root
    and its lineage (one agreement: every rank raises the same ``ConfigError``), the
    shared-storage probe, the purge of other lineages' node-local steps, this run's save
    generation, the ledger and its ``run_start`` record.

    Raises:
        ConfigError: as :class:`~tierckpt.engine.TieredCheckpointer` documents.
    """
    factor = cfg.replication_factor if "local" in cfg.tiers else 1
    topo, groups = discover(
        cfg.replication_jump, factor, node_id=node_id,
        ranks_per_node=cfg.simulated_ranks_per_node, timeout_s=cfg.collective_timeout_s,
        # a rank still waiting for its own stuck local save joins the vote up to
        # local_wait_timeout_s after its peers: the vote must not time out first
        control_timeout_s=max(cfg.collective_timeout_s, cfg.local_wait_timeout_s + 120.0),
    )
    world, in_use = groups.local_world, retention.InUse()
    local, err = open_local_tier(cfg, topo, groups.node, in_use)
    pstore, lineage_info, perr = open_persistent_root(cfg, topo.rank) if err is None else \
        (persistent_store(cfg), None, None)
    raise_if_any_failed(err or perr, world)
    run_id, (lineage_id, created, adopt) = broadcast_from_first(
        (uuid.uuid4().hex[:12], lineage_info) if topo.rank == 0 else None, world)
    persistent = PersistentTier(pstore, persistent_io, lineage=lineage_id)
    check_shared(pstore, run_id, topo.rank, world)
    if local is not None:
        purge_other_lineages(local, topo, in_use, lineage_id, adopt=adopt, created=created,
                             timeout_s=cfg.read_timeout_s)
    # every copy a save writes records its identity; the generation orders this run's saves
    # after every copy it could see (never by wall clocks: tierckpt/history/timeline.py)
    timeline = Timeline(run_id, agree_generation(local, persistent, topo, world, cfg.read_timeout_s))
    ledger = Ledger(pstore, enabled=topo.rank == 0, run_id=run_id, job=cfg.resolved_job_id())
    journal = RunJournal(ledger)
    journal.run_start(topo, cfg.tiers, lineage_id)
    return OpenedRun(topo, groups, local, persistent, lineage_id, timeline, ledger, journal, in_use)
