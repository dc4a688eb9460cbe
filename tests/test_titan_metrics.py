"""titan_plugin.metrics.TierMetrics: every save's δ, each tier's record once its future has
resolved (never waited for), every restore's time, sources and persistent bytes, with a fake
torchtitan metric logger. Also: the product never needs tierckpt_dev with an accelerator, and
names it without one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future

import pytest

from tierckpt import CheckpointRecord, RestoreResult, SaveHandle
from tierckpt.restore import NodeOutcome, Source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeLogger:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple[int, dict]] = []
        self.fail = fail

    def log(self, metrics: dict, step: int) -> None:
        if self.fail:
            raise RuntimeError("logger down")
        self.calls.append((step, dict(metrics)))


def _tm(logger):
    from titan_plugin.metrics import TierMetrics

    return TierMetrics(lambda: logger)


def test_save_delta_now_tier_records_when_resolved():
    fake = FakeLogger()
    tm = _tm(fake)
    local, persistent = Future(), Future()
    h = SaveHandle(10, 0.25, {"local": local, "persistent": persistent})
    tm.saved(h, 10)
    tm.poll(10)
    assert fake.calls == [(10, {"tierckpt/save/blocking_s": 0.25})]  # nothing waited for

    local.set_result(CheckpointRecord("local", 10, True, blocking_s=0.3, wait_s=0.01, bytes=4096,
                                      background_s=1.5))
    tm.poll(11)
    assert fake.calls[1] == (11, {"tierckpt/save/local/step": 10.0, "tierckpt/save/local/blocking_s": 0.3,
                                  "tierckpt/save/local/wait_s": 0.01, "tierckpt/save/local/background_s": 1.5,
                                  "tierckpt/save/local/bytes": 4096.0, "tierckpt/save/local/committed": 1.0,
                                  "tierckpt/save/local/failed": 0.0, "tierckpt/save/local/skipped": 0.0})
    tm.poll(12)
    assert len(fake.calls) == 2  # each record once

    persistent.set_result(CheckpointRecord("persistent", 10, False, error="OSError: [Errno 28]"))
    tm.poll(13)
    step, m = fake.calls[2]
    assert step == 13 and m["tierckpt/save/persistent/failed"] == 1.0 and m["tierckpt/save/persistent/skipped"] == 0.0


def test_skipped_tier_logged_at_its_step_and_cancelled_future_ignored():
    fake = FakeLogger()
    tm = _tm(fake)
    cancelled = Future()
    cancelled.cancel()
    skip = CheckpointRecord("local", 20, False, skipped=True, stuck_nodes=[1])
    tm.saved(SaveHandle(20, 0.0, {"persistent": cancelled}, skipped={"local": skip}), 20)
    tm.poll(21)
    assert [s for s, _ in fake.calls] == [20, 20]
    m = fake.calls[1][1]
    assert m["tierckpt/save/local/skipped"] == 1.0 and m["tierckpt/save/local/failed"] == 0.0


def test_restore_metrics_sources_and_persistent_bytes():
    fake = FakeLogger()
    tm = _tm(fake)
    res = RestoreResult(
        step=30, attempts=2, seconds=4.5, persistent_bytes_read=700,
        sources={0: NodeOutcome(0, 30, Source("own-local", 0), True, bytes=100),
                 1: NodeOutcome(1, 30, Source("peer-replica", 0), True, bytes=200),
                 2: NodeOutcome(2, 30, Source("persistent", None), True, bytes=700, persistent_bytes=700)},
        failures=[NodeOutcome(1, 30, Source("own-local", 1), False, error="gone")])
    tm.restored(res)
    assert fake.calls == [(30, {
        "tierckpt/restore/step": 30.0, "tierckpt/restore/seconds": 4.5, "tierckpt/restore/attempts": 2.0,
        "tierckpt/restore/bytes": 1000.0, "tierckpt/restore/persistent_bytes": 700.0,
        "tierckpt/restore/failures": 1.0, "tierckpt/restore/nodes/own-local": 1.0,
        "tierckpt/restore/nodes/peer-replica": 1.0, "tierckpt/restore/nodes/in-cluster": 0.0,
        "tierckpt/restore/nodes/persistent": 1.0})]


def test_schedule_decisions_and_a_broken_or_missing_logger_never_raise(caplog):
    fake = FakeLogger()
    tm = _tm(fake)
    tm.schedule([], 5)
    tm.schedule([{"tier": "local", "tau_steps": 7, "tau_s": 3.5, "delta": 0.2, "M": 900.0, "R": 60.0, "p": 0.01}], 5)
    assert fake.calls == [(5, {"tierckpt/local/tau_steps": 7.0, "tierckpt/local/tau_s": 3.5,
                               "tierckpt/local/delta_s": 0.2, "tierckpt/local/mtbf_s": 900.0,
                               "tierckpt/local/restart_s": 60.0, "tierckpt/local/p": 0.01})]
    _tm(None).saved(SaveHandle(1, 0.1), 1)  # no logger yet: nothing, no error
    broken = _tm(FakeLogger(fail=True))
    broken.saved(SaveHandle(1, 0.1), 1)
    broken.saved(SaveHandle(2, 0.1), 2)
    assert [r.getMessage() for r in caplog.records].count("tierckpt: could not log metrics: logger down") == 1


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_adapters_need_tierckpt_dev_only_without_an_accelerator():
    r = _run("""
        import sys, torch
        sys.modules["tierckpt_dev"] = None                 # as in an installed wheel
        torch.cuda.is_available = lambda: True             # an accelerator: nothing of it is imported
        from titan_plugin import train
        from mcore_plugin import pretrain
        assert train.apply_cpu_shims() == [] and pretrain.apply_cpu_shims() == []
        torch.cuda.is_available = lambda: False
        import tierckpt.integration
        if tierckpt.integration.accelerator_present():
            print("SKIP"); raise SystemExit(0)
        try:
            train.apply_cpu_shims()
        except train.CpuShimsMissing as e:
            print("TITAN", e)
        try:
            pretrain.apply_cpu_shims()
        except SystemExit as e:
            print("MCORE", e.code)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    if "SKIP" in r.stdout:
        pytest.skip("a real accelerator is present")
    assert "TITAN no accelerator" in r.stdout and "tierckpt_dev" in r.stdout, r.stdout
    assert "MCORE 2" in r.stdout and "error: no accelerator" in r.stderr and "tierckpt_dev" in r.stderr, r.stderr
