"""Save and restore metrics reach Megatron-LM's TensorBoard and W&B writers (stand-ins here; the
real ones exist on the last rank of a Megatron-LM run): δ at once, each tier's record once its
future resolved (never blocking), each restore's seconds, sources and persistent bytes."""

from __future__ import annotations

import sys
import types
from concurrent.futures import Future

from mcore_plugin import install
from mcore_plugin.metrics import TierMetrics
from tierckpt import CheckpointRecord, RestoreResult, SaveHandle
from tierckpt.restore import NodeOutcome, Source


class TB:
    def __init__(self):
        self.scalars, self.texts = [], []

    def add_scalar(self, k, v, it):
        self.scalars.append((k, v, it))

    def add_text(self, k, v, it):
        self.texts.append((k, v, it))


class WB:
    def __init__(self):
        self.calls = []

    def log(self, metrics, it):
        self.calls.append((metrics, it))


def _writers(monkeypatch):
    tb, wb = TB(), WB()
    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_tensorboard_writer = lambda: tb
    gv.get_wandb_writer = lambda: wb
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    if "megatron.training" not in sys.modules:
        monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    return tb, wb


def _restore_result() -> RestoreResult:
    def out(node, kind, holder):
        return NodeOutcome(node=node, step=20, source=Source(kind, holder), ok=True)

    return RestoreResult(step=20, sources={0: out(0, "own-local", 0), 1: out(1, "peer-replica", 2),
                                           2: out(2, "persistent", None)},
                         attempts=1, failures=[], seconds=3.5, persistent_bytes_read=4096)


def test_save_and_restore_metrics_go_to_megatron_writers(monkeypatch):
    tb, wb = _writers(monkeypatch)
    m = TierMetrics()
    rt = types.SimpleNamespace(tiers=types.SimpleNamespace(metrics=m))
    local, pers = Future(), Future()
    skipped = CheckpointRecord(tier="local", step=30, ok=False, skipped=True, error="hung disk")
    m.saved(SaveHandle(10, 0.25, {"local": local, "persistent": pers}))
    m.restored(_restore_result())

    # iteration 10: δ and the restore at once; nothing of the still running tiers
    install._log_tier_metrics(rt, 10)
    got = dict(wb.calls[-1][0])
    assert wb.calls[-1][1] == 10 and got["tierckpt/save/blocking_s"] == 0.25
    assert not any(k.startswith("tierckpt/save/local/") or k.startswith("tierckpt/save/persistent/") for k in got)
    assert got["tierckpt/restore/seconds"] == 3.5 and got["tierckpt/restore/step"] == 20.0
    assert got["tierckpt/restore/persistent_bytes"] == 4096.0
    assert [got[f"tierckpt/restore/nodes/{k}"] for k in ("own-local", "peer-replica", "persistent")] == [1.0] * 3
    assert got["tierckpt/restore/sources"] == "node 0: own-local, node 1: peer-replica, node 2: persistent"
    assert ("tierckpt/save/blocking_s", 0.25, 10) in tb.scalars
    assert tb.texts == [("tierckpt/restore/sources", got["tierckpt/restore/sources"], 10)]

    # iteration 11: the local tier committed; the persistent tier still runs
    local.set_result(CheckpointRecord(tier="local", step=10, ok=True, bytes=1000, background_s=1.5,
                                      blocking_s=0.25, wait_s=0.01))
    install._log_tier_metrics(rt, 11)
    got = dict(wb.calls[-1][0])
    assert wb.calls[-1][1] == 11
    assert got == {"tierckpt/save/local/step": 10.0, "tierckpt/save/local/blocking_s": 0.25,
                   "tierckpt/save/local/wait_s": 0.01, "tierckpt/save/local/background_s": 1.5,
                   "tierckpt/save/local/bytes": 1000.0, "tierckpt/save/local/committed": 1.0,
                   "tierckpt/save/local/skipped": 0.0, "tierckpt/save/local/failed": 0.0}

    # iteration 12: nothing new, nothing written
    n = len(wb.calls)
    install._log_tier_metrics(rt, 12)
    assert len(wb.calls) == n

    # iteration 30: the persistent tier failed; a new save skipped its local tier
    pers.set_result(CheckpointRecord(tier="persistent", step=10, ok=False, error="OSError: full",
                                     background_s=2.0))
    m.saved(SaveHandle(30, 0.5, {}, skipped={"local": skipped}))
    install._log_tier_metrics(rt, 30)
    got = dict(wb.calls[-1][0])
    assert got["tierckpt/save/persistent/failed"] == 1.0 and got["tierckpt/save/persistent/committed"] == 0.0
    assert got["tierckpt/save/persistent/step"] == 10.0
    assert got["tierckpt/save/local/skipped"] == 1.0 and got["tierckpt/save/local/failed"] == 0.0
    assert got["tierckpt/save/local/step"] == 30.0 and got["tierckpt/save/blocking_s"] == 0.5
    assert m.drain() == ({}, {})  # every record written once


def test_writer_errors_never_reach_training(monkeypatch):
    tb, wb = _writers(monkeypatch)

    def broken(metrics, it):
        raise RuntimeError("wandb run finished")

    wb.log = broken
    m = TierMetrics()
    m.saved(SaveHandle(5, 0.1, {}))
    install._log_tier_metrics(types.SimpleNamespace(tiers=types.SimpleNamespace(metrics=m)), 5)
    assert ("tierckpt/save/blocking_s", 0.1, 5) in tb.scalars
