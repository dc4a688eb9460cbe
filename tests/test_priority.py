"""Background priority (tierckpt/priority.py): the tiers' worker threads and the threads they start
run at a lower CPU and I/O priority than the trainer's thread, which keeps its own; bad values are
refused naming the option."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tierckpt import ConfigError, TierConfig
from tierckpt.priority import BackgroundPriority, ioprio_get, lower_current_thread
from tierckpt.tiers.workers import DaemonWorker

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice and ioprio are Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _observe() -> dict:
    """Priorities of the calling thread and of a thread it starts (inheritance)."""
    out = {"nice": _nice(threading.get_native_id()), "io": ioprio_get(threading.get_native_id())}
    child: dict = {}

    def run():
        child["nice"], child["io"] = _nice(threading.get_native_id()), ioprio_get(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    out["child"] = child
    return out


@linux
def test_worker_thread_runs_lower_and_its_threads_inherit():
    me = threading.get_native_id()
    base, base_io = _nice(me), ioprio_get(me)
    w = DaemonWorker("tierckpt-test", BackgroundPriority(nice=5, io_class="best-effort"))
    try:
        seen = w.submit(_observe).result(timeout=30)
    finally:
        w.shutdown()
    want = min(19, base + 5)
    be7 = (2 << 13) | 7
    assert seen["nice"] == want and seen["child"]["nice"] == want
    assert seen["io"] == be7 and seen["child"]["io"] == be7
    # the trainer's thread is untouched
    assert _nice(me) == base and ioprio_get(me) == base_io


@linux
def test_idle_class_and_off():
    w = DaemonWorker("tierckpt-idle", BackgroundPriority(nice=0, io_class="idle"))
    plain = DaemonWorker("tierckpt-plain", BackgroundPriority(nice=0, io_class="none"))
    me = threading.get_native_id()
    try:
        idle = w.submit(_observe).result(timeout=30)
        same = plain.submit(_observe).result(timeout=30)
    finally:
        w.shutdown()
        plain.shutdown()
    assert idle["io"] >> 13 == 3 and idle["nice"] == _nice(me)
    assert same["nice"] == _nice(me) and same["io"] == ioprio_get(me)


@linux
def test_refusal_is_a_warning_not_an_error(monkeypatch, caplog):
    import tierckpt.priority as pr

    def refuse(*_a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(pr.os, "setpriority", refuse)
    monkeypatch.setattr(pr, "_ioprio_set", refuse)
    monkeypatch.setattr(pr, "_warned", set())
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", lower_current_thread(BackgroundPriority(10, "idle"))))
    t.start()
    t.join()
    assert "r" in box
    text = caplog.text
    assert "could not lower the CPU priority" in text and "could not lower the I/O priority" in text


def test_engine_lanes_take_the_configured_priority(tmp_path):
    cfg = TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"),
                     background_nice=7, background_io_class="idle")
    assert cfg.background_priority == BackgroundPriority(7, "idle")
    assert TierConfig(local_root=str(tmp_path / "n{node}"),
                      persistent_root=str(tmp_path / "p")).background_priority == BackgroundPriority(10, "best-effort")


@pytest.mark.parametrize("field,value,words", [
    ("background_nice", 20, ["background_nice", "19"]),
    ("background_nice", -1, ["background_nice", "0"]),
    ("background_nice", 2.5, ["background_nice"]),
    ("background_io_class", "low", ["background_io_class", "best-effort", "idle", "none"]),
])
def test_bad_values_name_the_option(tmp_path, field, value, words):
    with pytest.raises(ConfigError) as e:
        TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"), **{field: value})
    for w in words:
        assert w in str(e.value)
