"""A read of a restore's source that hangs (issue 29 case C): bounded by
``restore_read_timeout_s``, the source counts as failed and the restore falls back."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests import scenarios, scenarios_hung
from tests.harness import run_world
from tierckpt import TierConfig
from tierckpt.errors import ConfigError, ReadTimeout
from tierckpt.io.bounded import run_bounded

K = 2
# the setting: a 30 s gloo timeout; the read bound is then its default, 10 s
CFG = {"collective_timeout_s": 30}
BOUND = 10.0
SLACK = 25.0  # a loaded 2-core machine: two attempts, the loads, the fallback's pull


@pytest.fixture
def saved(tmp_path):
    base = str(tmp_path)
    run_world(scenarios.phase_train_and_save, 2, base, 1, K, 2, CFG, timeout=300)
    return base


def _check(base: str, res, node: int, want_source: str, failed_source: str) -> None:
    for r in res:
        v = r.value
        assert v["step"] == K, v
        assert v["sources"][node][0] == want_source, v
        assert v["wall"] < BOUND + SLACK, f"restore took {v['wall']:.1f} s for a {BOUND:g} s read bound: {v}"
        hung = [f for f in v["failures"] if f[0] == node and f[1] == failed_source]
        assert hung and "timed out" in hung[0][4], v
    (rec,) = scenarios_hung.ledger_restores(base)
    assert rec["step"] == K and rec["sources"][str(node)]["source"] == want_source, rec
    assert any(f["node"] == node and f["source"] == failed_source and "timed out" in (f["error"] or "")
               for f in rec["failures"]), rec["failures"]


def test_hung_own_copy_falls_back_to_the_replica_within_the_bound(saved):
    step = os.path.join(saved, "nvme", "node-1", "local", f"step-{K}")
    for name in scenarios_hung.data_files(step):
        scenarios_hung.hang(os.path.join(step, name))
    res = run_world(scenarios_hung.phase_restore_timed, 2, saved, CFG, timeout=240)
    _check(saved, res, 1, "peer-replica", "own-local")
    assert res[0].value["sources"][0][0] == "own-local"


def test_hung_replica_sender_falls_back_to_persistent_within_the_bound(saved):
    import shutil

    shutil.rmtree(os.path.join(saved, "nvme", "node-1", "local", f"step-{K}"))  # node 1 lost its disk
    rep = os.path.join(saved, "nvme", "node-0", "replicas", "node-1", f"step-{K}")
    for name in scenarios_hung.data_files(rep):
        scenarios_hung.hang(os.path.join(rep, name))
    res = run_world(scenarios_hung.phase_restore_timed, 2, saved, CFG, timeout=240)
    _check(saved, res, 1, "persistent", "peer-replica")
    assert res[0].value["sources"][0][0] == "own-local"


def test_read_bound_option_is_validated():
    assert TierConfig(persistent_root="/tmp/x", tiers=("persistent",)).read_timeout_s == 60.0
    assert TierConfig(persistent_root="/tmp/x", tiers=("persistent",), collective_timeout_s=30).read_timeout_s == 10.0
    assert TierConfig(persistent_root="/tmp/x", tiers=("persistent",), restore_read_timeout_s=5).read_timeout_s == 5.0
    for bad in (0, -1, True, "5", float("nan"), 301):
        with pytest.raises(ConfigError, match="restore_read_timeout_s") as e:
            TierConfig(persistent_root="/tmp/x", tiers=("persistent",), restore_read_timeout_s=bad)
        assert "collective_timeout_s / 2 = 300" in str(e.value)


def test_run_bounded_leaves_a_hung_read_behind(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    late: list = []

    def read(progress):
        progress.tick(fifo)
        with open(fifo, "rb") as f:  # blocks until a writer opens it
            late.append(f.read())
        progress.tick()
        return "late"

    t0 = time.monotonic()
    with pytest.raises(ReadTimeout, match="timed out, no progress for 0.5 s .reading .*fifo"):
        run_bounded(read, 0.5, "test read")
    assert time.monotonic() - t0 < 10
    # the helper finishes later; its result goes nowhere and a later wait is not disturbed
    w = threading.Thread(target=lambda: open(fifo, "wb").close())
    w.start()
    w.join(10)
    assert run_bounded(lambda p: 7, 0.5, "next") == 7
