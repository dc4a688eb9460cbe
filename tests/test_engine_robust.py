"""Robust restores (issue 15, the engine's part), 2 nodes × 1 rank, F = 2, FSDP2 + AdamW plus a
plain per-rank tensor (tests/scenarios_robust.py):

- a second node loss right after a restore, before any save, still restores in-cluster: the
  restore rebuilt the lost node's replica of its peer (ledger ``redundancy``);
- swapped local roots (a remapped disk): each node restores its own state from the replica of
  itself it now holds, nothing is deleted, the per-rank tensor comes back on the right rank;
- the only copies of a node's state corrupt and no persistent step: a clean NoCheckpointError,
  and no committed copy deleted;
- a pull that fails with a transport error falls back (agreed), and the directory it would
  have replaced — another node's copy — is kept;
- a restore while a local write hangs returns after ``local_wait_timeout_s`` without that
  node's local root.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests import scenarios_robust as sr
from tests.harness import run_world
from tierckpt.io import manifest
from tierckpt.io.storage import Store

K = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step K committed in every tier (local, replicas, persistent) by 2 nodes."""
    base = str(tmp_path_factory.mktemp("robust"))
    run_world(sr.phase_save, 2, base, K, {})
    return base


def _copy(saved, tmp_path, persistent=True):
    dst = str(tmp_path / "run")
    shutil.copytree(saved, dst)
    if not persistent:  # "only the local tier": the step exists nowhere else
        shutil.rmtree(os.path.join(dst, "pfs", f"step-{K}"))
    return dst


def _swap_roots(base):
    nvme = os.path.join(base, "nvme")
    os.rename(os.path.join(nvme, "node-0"), os.path.join(nvme, "tmp"))
    os.rename(os.path.join(nvme, "node-1"), os.path.join(nvme, "node-0"))
    os.rename(os.path.join(nvme, "tmp"), os.path.join(nvme, "node-1"))


def _committed(base) -> dict[str, int]:
    """{"node-<h>/<dir>": node named by its manifest} of every committed node-local copy."""
    out = {}
    for h in ("node-0", "node-1"):
        store = Store(os.path.join(base, "nvme", h))
        for parent in ["local"] + [f"replicas/{n}" for n in store.listdir("replicas")]:
            for name in store.listdir(parent):
                doc = manifest.read_committed(store, f"{parent}/{name}")
                if doc is not None:
                    out[f"{h}/{parent}/{name}"] = doc["node"]
    return out


def _ledger(base, kind):
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _corrupt(path):
    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, data), "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0xFF]))


def test_second_loss_after_a_restore_still_restores_in_cluster(saved, tmp_path):
    base = _copy(saved, tmp_path, persistent=False)
    shutil.rmtree(os.path.join(base, "nvme", "node-1"))
    out = run_world(sr.phase_two_losses, 2, base, {})[0].value
    first, second = out["first"], out["second"]
    assert first["step"] == K and first["sources"] == {0: ("own-local", 0), 1: ("peer-replica", 0)}, first
    # node 1 got node 0's replica back in the background, right after the first restore
    assert (first["redundancy"]["ok"], first["redundancy"]["nodes"], first["redundancy"]["missing"]) == (True, [0], [])
    assert second["step"] == K and second["sources"] == {0: ("peer-replica", 1), 1: ("own-local", 1)}, second
    assert first["persistent_bytes"] == second["persistent_bytes"] == 0
    reds = _ledger(base, "redundancy")
    assert [(r["step"], r["ok"], r["nodes"], r["missing"]) for r in reds] == [(K, True, [0], []), (K, True, [1], [])]
    assert reds[0]["bytes"] > 0 and reds[0]["error"] is None
    assert _committed(base) == {"node-0/local/step-3": 0, "node-0/replicas/node-1/step-3": 1,
                                "node-1/local/step-3": 1, "node-1/replicas/node-0/step-3": 0}


def test_swapped_roots_restore_own_state_and_delete_nothing(saved, tmp_path):
    base = _copy(saved, tmp_path)
    _swap_roots(base)
    before = _committed(base)
    assert before["node-0/local/step-3"] == 1 and before["node-0/replicas/node-0/step-3"] == 0
    out = run_world(sr.phase_restore, 2, base, {})[0].value  # mine == 100 + rank is asserted per rank
    assert out["step"] == K and out["sources"] == {0: ("own-local", 0), 1: ("own-local", 1)}, out
    assert out["persistent_bytes"] == 0 and not out["failures"]
    assert out["redundancy"] is None and not _ledger(base, "redundancy")  # every state has its 2 copies
    assert _committed(base) == before


def test_only_copies_corrupt_gives_no_checkpoint_error_and_deletes_nothing(saved, tmp_path):
    base = _copy(saved, tmp_path, persistent=False)
    _swap_roots(base)
    # both copies of node 0's state: its replica of itself on node 0, node 1's local/ (node 0's state)
    _corrupt(os.path.join(base, "nvme", "node-0", "replicas", "node-0", f"step-{K}"))
    _corrupt(os.path.join(base, "nvme", "node-1", "local", f"step-{K}"))
    before = _committed(base)
    results = run_world(sr.phase_restore, 2, base, {})
    for r in results:  # every rank: the same clean error, no raw transport error
        assert "no source could restore any step" in r.value["error"], r.value
    assert "peer-replica@1" in results[0].value["error"] and "in-cluster" in results[0].value["error"]
    assert _committed(base) == before  # the failed pull left node 1's state (node 0's local/) alone


def test_failed_pull_keeps_the_copy_it_would_replace(saved, tmp_path):
    base = _copy(saved, tmp_path)
    _swap_roots(base)
    # each root now holds only the other node's state, in local/: both nodes must pull
    for h in ("node-0", "node-1"):
        shutil.rmtree(os.path.join(base, "nvme", h, "replicas"))
    out = run_world(sr.phase_restore, 2, base, {}, True)[0].value
    assert out["step"] == K and out["sources"] == {0: ("persistent", None), 1: ("peer-replica", 0)}, out
    assert any(f[:3] == (0, "peer-replica", 1) and "Pair is not connected" in f[4] for f in out["failures"]), out
    # node 0's failed pull left node 1's state in node 0's local/; node 1's pull moved node 0's
    # state from its local/ to a replica instead of deleting it
    assert _committed(base) == {"node-0/local/step-3": 1, "node-1/local/step-3": 1, "node-1/replicas/node-0/step-3": 0}
    (red,) = _ledger(base, "redundancy")
    assert (red["ok"], red["nodes"], red["missing"]) == (False, [], [0]) and "next local save" in red["reason"]


def test_restore_while_a_local_write_hangs(tmp_path):
    base = str(tmp_path)
    limit = 3.0
    out = run_world(sr.phase_restore_while_local_hangs, 2, base, limit)[0].value
    assert out["step"] == K and out["sources"] == {0: ("own-local", 0), 1: ("persistent", None)}, out
    assert limit <= out["restore_s"] < limit + 60, out
    (red,) = _ledger(base, "redundancy")
    assert (red["ok"], red["missing"]) == (False, [0, 1]) and "still running on node(s) [1]" in red["reason"]


def test_read_only_persistent_root_still_restores(saved, tmp_path):
    base = _copy(saved, tmp_path)
    out = run_world(sr.phase_read_only_persistent_root, 2, base)
    for r in out:
        v = r.value
        assert v["step"] == K and {s for s, _ in v["sources"].values()} == {"own-local"}, v
        assert v["persistent_ok"] is False and v["close"].startswith("TierFailedError"), v


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread does die
def test_a_dead_worker_thread_fails_its_jobs_and_is_replaced():
    """A tier worker whose thread dies outside any job (a bug) must not leave a waiter hanging:
    its jobs fail with the cause, and the next submit runs on a new thread."""
    import threading
    import time
    from concurrent.futures import Future

    from tierckpt.tiers.workers import DaemonWorker

    w = DaemonWorker("tierckpt-test")
    gate = threading.Event()
    first = w.submit(gate.wait, 30)
    queued = w.submit(lambda: "never")
    while not first.running():  # the thread has taken the first job: the next one it takes dies
        time.sleep(0.01)
    real = Future.set_running_or_notify_cancel

    def die(self):
        Future.set_running_or_notify_cancel = real
        raise RuntimeError("injected: the thread dies")

    Future.set_running_or_notify_cancel = die
    gate.set()
    assert first.result(timeout=30) is True
    with pytest.raises(RuntimeError, match="worker thread died"):
        queued.result(timeout=30)
    assert w.submit(lambda: 42).result(timeout=30) == 42
    w.shutdown()


def test_a_job_that_never_ran_reads_as_a_failed_record():
    """A save handle's future resolves to a failed record, never raises, when the job's worker
    thread died before running it (the campaign's dying-writer-thread fault)."""
    from concurrent.futures import Future

    from tierckpt.tiers.lanes import _never_raising

    inner: Future = Future()
    out = _never_raising(inner, "persistent", 7)
    inner.set_exception(RuntimeError("the tierckpt-persistent worker thread died"))
    rec = out.result(timeout=5)
    assert not rec.ok and rec.step == 7 and rec.tier == "persistent" and "worker thread died" in rec.error
