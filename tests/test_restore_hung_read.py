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


def _committed_step(tmp_path, files: dict[str, bytes]):
    from tierckpt.io import manifest
    from tierckpt.io.storage import Store

    store = Store(str(tmp_path))
    os.makedirs(store.path("s"))
    for name, b in files.items():
        with open(store.path(f"s/{name}"), "wb") as f:
            f.write(b)
    manifest.commit(store, "s", [manifest.FileEntry(n, len(b), manifest.hash_file(store, f"s/{n}").xxh3_64)
                                 for n, b in files.items()])
    return store


def test_own_read_whose_pages_never_come_times_out_and_is_left_behind(tmp_path, monkeypatch):
    """The mapping succeeded but the read of the big file's pages hangs (a hung disk inside a
    page fault): the load's wait for those pages, the result and the cleanup all end within
    the bound; the small file read before it stays usable."""
    from tierckpt.io import memory_read

    store = _committed_step(tmp_path, {".metadata": b"m" * 100, "__0_0.distcp": os.urandom(3 << 20)})
    touch = memory_read.touch_share

    def hanging_touch(entries, mapped, done):
        touch([e for e in entries if e.size <= 100], mapped, done)  # the small file arrives
        threading.Event().wait()  # the big one never does

    monkeypatch.setattr(memory_read, "touch_share", hanging_touch)
    t0 = time.monotonic()
    own = memory_read.OwnRead(store, "s", 0, 1, 1 << 30, timeout_s=1.0)
    assert own.started and set(own.mapped()) == {".metadata", "__0_0.distcp"}
    own.wait(".metadata", 100)  # read: no wait
    with pytest.raises(ReadTimeout, match="no progress for 1 s"):
        own.wait("__0_0.distcp", 4096)
    with pytest.raises(ReadTimeout):  # given up once: at once
        own.result()
    own.join()  # the cleanup does not wait for the stuck helper
    assert time.monotonic() - t0 < 8


def test_own_read_that_blocks_on_open_times_out(tmp_path):
    from tierckpt.io import memory_read

    store = _committed_step(tmp_path, {".metadata": b"m" * 100, "__0_0.distcp": os.urandom(8192)})
    scenarios_hung.hang(store.path("s/__0_0.distcp"))
    own = memory_read.OwnRead(store, "s", 0, 1, 1 << 30, timeout_s=1.0)
    with pytest.raises(ReadTimeout, match=r"reading .*__0_0.distcp"):
        own.mapped()
    own.join()
    threading.Thread(target=lambda: open(store.path("s/__0_0.distcp"), "wb").close(), daemon=True).start()


def test_a_send_whose_read_stalls_mid_stream_completes_the_stream_with_zeros(tmp_path):
    """The receiver has posted every chunk's receive: the sender finishes the stream (zeros,
    rejected by the checksums) within the bound instead of leaving it to the gloo timeout."""
    out = run_world(scenarios_hung.phase_send_stalls_mid_stream, 2, str(tmp_path), 2.0, timeout=180)
    send_s, recv = out[0].value[0], out[1].value
    assert send_s < 2.0 + 25 and recv[0] < 2.0 + 25, (send_s, recv)
    assert any("__0_0.distcp: checksum mismatch" in p for p in recv[1]), recv
    assert recv[2] == ["__3_0.distcp"], recv  # only the empty file, which has no chunk, is intact


def test_hung_listing_of_a_local_root_is_bounded(saved):
    """The inventory's listing of a node-local root that hangs is bounded too: that node then
    holds nothing local, and its state comes from its peer's replica (the restore does not wait
    for the hung disk, nor end in a collective timeout)."""
    res = run_world(scenarios_hung.phase_restore_hung_listing, 2, saved, CFG, 1, timeout=240)
    for r in res:
        v = r.value
        assert v["step"] == K and v["sources"][1][0] == "peer-replica" and v["sources"][0][0] == "own-local", v
        assert v["wall"] < BOUND + SLACK, v


@pytest.mark.parametrize("where", ["every", "load"], ids=["checksum-read-hangs", "dcp-load-hangs"])
def test_hung_persistent_read_falls_back_to_an_older_persistent_step_within_the_bound(tmp_path, where):
    """Both node-local roots are gone and the newest persistent step's data file hangs (opens
    of it never return, on every rank: a shared file system that stops answering on one file;
    a FIFO in its place would not do here, the size check refuses it before any read): every
    open, so the verification's checksum read hangs, or only DCP's (the checksums pass, the
    load hangs); an older persistent step is intact. The restore gives the hung step up within ``restore_read_timeout_s`` (the
    persistent tier is the last source: nothing else can serve that step), falls back to the
    older step on every rank, bitwise (values and the next losses), and the ledger's restore
    record names the timed-out persistent read of the newer step."""
    import shutil

    base = str(tmp_path)
    old, new = 2, 4
    committed = run_world(scenarios_hung.phase_two_persistent_steps, 2, base, CFG, old, new, timeout=300)
    assert committed[0].value == [old, new], committed[0].value
    shutil.rmtree(os.path.join(base, "nvme"))  # every node lost its disk
    step = os.path.join(base, "pfs", f"step-{new}")
    files = scenarios_hung.data_files(step)
    assert files, os.listdir(step)
    res = run_world(scenarios_hung.phase_restore_timed_hung_file, 2, base, CFG, os.path.join(step, files[0]),
                    where, timeout=240)
    for r in res:
        v = r.value
        assert v["step"] == old, v
        assert {n: s[0] for n, s in v["sources"].items()} == {0: "persistent", 1: "persistent"}, v
        assert v["wall"] < BOUND + SLACK, f"restore took {v['wall']:.1f} s for a {BOUND:g} s read bound: {v}"
        hung = [f for f in v["failures"] if f[1] == "persistent" and f[3] == new]
        assert hung and all("timed out" in f[4] for f in hung), v
    (rec,) = scenarios_hung.ledger_restores(base)
    assert rec["step"] == old and {s["source"] for s in rec["sources"].values()} == {"persistent"}, rec
    named = [f for f in rec["failures"] if f["source"] == "persistent" and f["step"] == new]
    assert named and all("timed out" in (f["error"] or "") for f in named), rec["failures"]
    assert files[0] in " ".join(f["error"] for f in named), rec["failures"]
