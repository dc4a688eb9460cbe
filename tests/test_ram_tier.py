"""The local tier in host memory: ``local_root`` under /dev/shm (tmpfs).

Multi-process tests (gloo, 2 ranks as 2 nodes): a process restart restores each node's own step
from RAM; a node whose RAM root was wiped restores from its neighbour's replica in RAM without
reading the persistent tier; a RAM root too small for the footprint turns the local tier off
with a warning while the persistent tier still commits. Unit tests: tmpfs detection, the
footprint formula and the state-size estimate.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile

import pytest
import torch

from tests import scenarios
from tests.harness import run_world
from tierckpt.engine import TieredCheckpointer
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.tiers import ram

K, EXTRA = 3, 3
SHM = "/dev/shm"


def _shm_or_skip() -> None:
    if not os.path.isdir(SHM):
        pytest.skip(f"{SHM} does not exist on this machine")
    kind = ram.fs_type(SHM)
    if kind not in ram.RAM_FS_TYPES:
        pytest.skip(f"{SHM} is not tmpfs here (file system type {kind!r})")


@pytest.fixture
def shm():
    """A unique directory under /dev/shm, removed at the end even when the test fails."""
    _shm_or_skip()
    d = tempfile.mkdtemp(prefix="tierckpt-test-ram-", dir=SHM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _cfg_kw(shm_dir: str, **kw) -> dict:
    return {"local_root": os.path.join(shm_dir, "node-{node}"), **kw}


# -- multi-process -----------------------------------------------------------------------------
def test_process_restart_restores_own_local_from_ram(shm, tmp_path):
    base = str(tmp_path)
    first = run_world(scenarios.phase_train_and_save, 2, base, 1, K, EXTRA, _cfg_kw(shm))
    local = [h for h in first[0].value["history"] if h.tier == "local"]
    assert [(h.step, h.ok) for h in local] == [(K, True)], local
    for n, peer in ((0, 1), (1, 0)):
        assert os.path.exists(os.path.join(shm, f"node-{n}", "local", f"step-{K}", "tierckpt.committed"))
        assert os.path.exists(os.path.join(shm, f"node-{n}", "replicas", f"node-{peer}", f"step-{K}",
                                           "tierckpt.committed"))
    # new processes (the old ones exited): bitwise state and equal losses are checked in the phase
    out = run_world(scenarios.phase_restore_and_check, 2, base, 1, K, EXTRA, _cfg_kw(shm))[0].value
    assert out["step"] == K
    assert out["sources"] == {0: ("own-local", 0), 1: ("own-local", 1)}, out
    assert out["persistent_bytes"] == 0


def test_wiped_ram_root_restores_from_neighbour_replica(shm, tmp_path):
    base = str(tmp_path)
    run_world(scenarios.phase_train_and_save, 2, base, 1, K, EXTRA, _cfg_kw(shm))
    shutil.rmtree(os.path.join(shm, "node-1"))  # node 1 rebooted: its tmpfs is empty
    out = run_world(scenarios.phase_restore_and_check, 2, base, 1, K, EXTRA, _cfg_kw(shm))[0].value
    assert out["step"] == K
    assert out["sources"] == {0: ("own-local", 0), 1: ("peer-replica", 0)}, out
    assert out["persistent_bytes"] == 0, "the persistent tier must not be read"
    assert os.path.exists(os.path.join(shm, "node-1", "local", f"step-{K}", "tierckpt.committed"))


def phase_ram_too_small(rank, world, base, shm_dir):
    """The RAM root reports 1 free byte: the local tier turns off with a warning at the first
    save, the persistent tier commits every step, and restore reads it bitwise."""
    ram.free_bytes = lambda path: 1  # the one measurement the fit check takes of the tmpfs
    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("tierckpt.tiers.ram").addHandler(Grab())  # the RAM guard (tierckpt/tiers/ram.py)
    eng = TieredCheckpointer(scenarios.make_config(base, **_cfg_kw(shm_dir)), node_id=rank)
    model, opt = scenarios.build(seed=0)
    handles = []
    for s in (1, 2):
        scenarios.train_step(model, opt, s, rank)
        handles.append(eng.save(s, scenarios.app_state(model, opt)))
    ref = scenarios.snapshot(model, opt)
    eng.wait()
    out = {
        "skipped": [(s, sorted(h.skipped), sorted(h.futures)) for s, h in zip((1, 2), handles)],
        "persistent_ok": [h.futures["persistent"].result().ok for h in handles],
        "local_errors": [h.skipped["local"].error for h in handles],
        "warnings": [m for m in seen if "too small" in m],
        "committed": eng.committed_steps(),
    }
    m2, o2 = scenarios.build(seed=7)
    sd = scenarios.app_state(m2, o2)
    res = eng.restore(sd)
    scenarios.apply_state(m2, o2, sd)
    scenarios.assert_bitwise(scenarios.snapshot(m2, o2), ref)
    out["restored"] = (res.step, res.source_of(rank))
    eng.close()
    return out


def test_ram_root_too_small_degrades_local_tier(shm, tmp_path):
    res = run_world(phase_ram_too_small, 2, str(tmp_path), shm)
    for r in res:
        out = r.value
        assert out["skipped"] == [(1, ["local"], ["persistent"]), (2, ["local"], ["persistent"])], out
        assert out["persistent_ok"] == [True, True]
        for err in out["local_errors"]:
            assert "keep_latest_k.local" in err and "replication_factor" in err and "local_root" in err
        assert out["committed"] == {"local": [], "persistent": [1, 2]}
        assert out["restored"] == (2, "persistent")
    assert len(res[0].value["warnings"]) == 1, res[0].value["warnings"]  # said once, by rank 0
    assert res[1].value["warnings"] == []
    for n in (0, 1):
        assert not os.path.exists(os.path.join(shm, f"node-{n}", "local", "step-1"))


def phase_ram_retention_no_odirect(rank, world, base, shm_dir):
    """Older kernels refuse O_DIRECT on tmpfs (EINVAL): replication must fall back to
    buffered writes. Three saves with keep_latest_k.local = 2 leave steps 2 and 3, own and
    replica, each verifying against its manifest."""
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT refused (old tmpfs)", path)
        return real_open(path, flags, *a, **kw)

    os.open = no_direct
    cfg = scenarios.make_config(base, **_cfg_kw(shm_dir, keep_latest_k={"local": 2, "persistent": 1}))
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = scenarios.build(seed=0)
    for s in (1, 2, 3):
        scenarios.train_step(model, opt, s, rank)
        eng.save(s, scenarios.app_state(model, opt), tiers=["local"])
        eng.wait()
    eng.close()
    store = Store(cfg.local_root_for(rank))
    peer = 1 - rank
    problems = []
    for rel in (layout.local_step(2), layout.local_step(3), layout.replica_step(peer, 2), layout.replica_step(peer, 3)):
        doc = manifest.read_committed(store, rel)
        problems += [f"{rel}: not committed"] if doc is None else \
            manifest.verify_files(store, rel, manifest.entries_of(doc))
    return {"own": eng.local.committed_steps(), "replicas": eng.local.committed_replicas(), "problems": problems}


def test_ram_root_retention_and_buffered_replication(shm, tmp_path):
    res = run_world(phase_ram_retention_no_odirect, 2, str(tmp_path), shm)
    for r in res:
        peer = 1 - r.rank
        assert r.value == {"own": [2, 3], "replicas": {peer: [2, 3]}, "problems": []}, r.value


# -- units -------------------------------------------------------------------------------------
def test_fs_type_longest_mount_wins(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n"
                      "tmpfs /dev/shm tmpfs rw 0 0\n"
                      "tmpfs /mnt/my\\040ram tmpfs rw 0 0\n"
                      "/dev/nvme0n1 /dev/shm/disk xfs rw 0 0\n")
    assert ram.fs_type("/dev/shm/job/node-0", str(mounts)) == "tmpfs"
    assert ram.fs_type("/dev/shm/disk/node-0", str(mounts)) == "xfs"
    assert ram.fs_type("/dev/shmx", str(mounts)) == "ext4"
    assert ram.fs_type("/mnt/my ram/a", str(mounts)) == "tmpfs"
    assert ram.fs_type("/x", str(tmp_path / "absent")) is None


def test_footprint_formula():
    # 4 nodes, J = 1, F = 2: cliques {0, 1} and {2, 3}; node 0 holds its own state and node 1's
    sizes = {0: 100, 1: 300, 2: 50, 3: 50}
    assert ram.footprint(0, sizes, keep=2, jump=1, factor=2) == 3 * (100 + 300)
    assert ram.footprint(2, sizes, keep=2, jump=1, factor=2) == 3 * (50 + 50)
    assert ram.footprint(0, sizes, keep=2, jump=1, factor=1) == 3 * 100
    assert ram.footprint(0, sizes, keep=0, jump=1, factor=2) == 100 + 300  # keep all: one more step
    reports = [ram.RankReport(0, 40, 60, ram=True, available=1199),
               ram.RankReport(1, 300, 0, ram=True, available=1200),
               ram.RankReport(2, 50, 0, ram=False), ram.RankReport(3, 50, 0, ram=None)]
    assert ram.node_bytes(reports) == sizes
    assert ram.too_small(reports, keep=2, jump=1, factor=2) == {0: (1200, 1199)}


def test_node_bytes_counts_replicated_once_per_node():
    reports = [ram.RankReport(0, 10, 500), ram.RankReport(0, 20, 500), ram.RankReport(1, 5, 7)]
    assert ram.node_bytes(reports) == {0: 10 + 20 + 500, 1: 12}


def test_state_bytes_plain_tensors_are_replicated():
    sd = {"model": {"w": torch.zeros(4, 8, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.bfloat16)},
          "optim": {"state": [torch.zeros(10, dtype=torch.int64)], "lr": 0.1}, "step": 3}
    assert ram.state_bytes(sd) == (0, 4 * 8 * 4 + 3 * 2 + 10 * 8)


def test_dev_shm_detected_as_ram():
    _shm_or_skip()
    assert ram.is_ram_root(os.path.join(SHM, "not-created-yet", "node-0"))
    assert ram.free_bytes(SHM) > 0
