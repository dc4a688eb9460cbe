"""Reads outside a restore's sources that a hung file system must not hold forever (issue 29
case C, the rest): the engine's start over a hung node-local root, a replicated value read
from another rank's file, the persistent tier's listing, the exit's final persistent read and
the save-on-loader-death decision. Each injects a read that never returns (a FIFO in place of
a file, as tests/scenarios_hung.py does, or an open patched to block) and runs under a harness
timeout, so the original code fails by timing out instead of hanging the suite."""

from __future__ import annotations

import os
import shutil

import pytest

from tests import scenarios, scenarios_hung, scenarios_hung_edges as sh
from tests.harness import run_world

K = 2
CFG = {"collective_timeout_s": 30}  # the read bound is then its default, 10 s
BOUND = 10.0
SLACK = 30.0  # a loaded 2-core machine


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hung-edges"))
    run_world(scenarios.phase_train_and_save, 2, base, 1, K, 2, CFG, timeout=300)
    return base


@pytest.fixture
def saved(saved_base, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(saved_base, dst)
    return dst


def _marker(*parts: str) -> str:
    return os.path.join(*parts, "tierckpt.committed")


def test_engine_start_over_a_hung_local_root_continues(saved):
    """Node 1's local root hangs (a FIFO in place of its step's commit marker: every read of it
    blocks): the engine's start (purge, generation survey) gives up on it within the bound,
    takes the node as holding nothing local and continues; the restore serves node 1 from
    another source, bitwise."""
    scenarios_hung.hang(_marker(saved, "nvme", "node-1", "local", f"step-{K}"))
    res = run_world(sh.phase_start_and_restore, 2, saved, CFG, timeout=240)
    for r in res:
        v = r.value
        assert v["step"] == K and v["sources"][0][0] == "own-local", v
        assert v["sources"][1][0] in ("peer-replica", "persistent"), v
        assert v["start"] < BOUND + SLACK, f"the engine's start took {v['start']:.1f} s: {v}"
        assert v["wall"] < BOUND + SLACK, f"the restore took {v['wall']:.1f} s: {v}"


def test_hung_persistent_listing_falls_back_to_the_local_tier(saved):
    """The persistent root hangs (a FIFO in place of its step's commit marker): its listing
    (at the start, and in the restore's inventory) gives up within the bound and the restore
    is served by the node-local copies, bitwise."""
    scenarios_hung.hang(_marker(saved, "pfs", f"step-{K}"))
    res = run_world(sh.phase_start_and_restore, 2, saved, CFG, timeout=240)
    for r in res:
        v = r.value
        assert v["step"] == K and {s[0] for s in v["sources"].values()} == {"own-local"}, v
        assert v["start"] < BOUND + SLACK and v["wall"] < BOUND + SLACK, v


def test_hung_persistent_listing_with_nothing_local_raises_a_tier_failure(saved):
    """Nothing node-local and the persistent root hangs: every rank raises TierUnreachableError
    (a TierFailedError) naming the root within the bound, instead of hanging or starting
    fresh over the checkpoints the root may hold."""
    shutil.rmtree(os.path.join(saved, "nvme"))
    scenarios_hung.hang(_marker(saved, "pfs", f"step-{K}"))
    res = run_world(sh.phase_start_and_restore, 2, saved, CFG, timeout=240)
    pfs = os.path.join(saved, "pfs")
    for r in res:
        v = r.value
        assert "error" in v, v
        name, msg = v["error"]
        assert name == "TierUnreachableError" and pfs in msg and "timed out" in msg, v
        assert v["start"] < BOUND + SLACK and v["wall"] < BOUND + SLACK, v
    from tierckpt.errors import TierFailedError, TierUnreachableError

    assert issubclass(TierUnreachableError, TierFailedError)


def test_replicated_value_in_another_ranks_file_is_read_bounded(tmp_path):
    """Two ranks per node: DCP wrote each replicated value (``shared``, ``note``) into one rank's
    file, which the node's other rank reads from disk. On node 1 those reads never return:
    they are bounded, node 1's own copy counts as failed (timed out) and the restore falls
    back; every rank still gets its own values bitwise."""
    from tests import scenarios_per_rank as sp

    base = str(tmp_path)
    run_world(sp.phase_save, 4, base, 2, K, timeout=300)
    res = run_world(sh.phase_restore_other_files_hang, 4, base, 2, CFG, timeout=300)
    for r in res:
        v = r.value
        assert v["step"] == K and v["sources"][0][0] == "own-local", v
        assert v["sources"][1][0] in ("peer-replica", "persistent"), v
        assert any(f[0] == 1 and f[1] == "own-local" and "timed out" in (f[4] or "") for f in v["failures"]), v
        # own copy, and maybe the pulled replica (the same hung root): one bound each
        assert v["wall"] < 2 * BOUND + SLACK, v


def _run_exit_script(base: str, mode: str, world: int = 2, timeout: float = 240) -> list[tuple[int | None, str, float]]:
    """tests/exit_hung_script.py on ``world`` processes (torchrun's environment): each one's
    (exit status, output, seconds from its ``LEAVING`` line to its end); killed after
    ``timeout`` seconds (status None)."""
    import subprocess
    import sys
    import tempfile
    import time

    from tests.harness import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    procs, outs = [], []
    for r in range(world):
        env = {**os.environ, "PYTHONPATH": root, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        out = tempfile.TemporaryFile(mode="w+")
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.exit_hung_script", base, mode], cwd=root,
                                      env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
    ended: dict[int, float] = {}
    deadline = time.time() + timeout
    while len(ended) < world and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.1)
    res = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            p.wait()
        outs[r].seek(0)
        text = outs[r].read()
        leaving = [float(x.split()[1]) for x in text.splitlines() if x.startswith("LEAVING ")]
        took = ended[r] - leaving[0] if r in ended and leaving else float("inf")
        res.append((p.returncode if r in ended else None, text, took))
    return res


def _ledger(base: str, name: str = "tierckpt-ledger.jsonl") -> list[dict]:
    import json

    with open(os.path.join(base, "pfs", name)) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_exit_confirming_the_durable_step_on_a_hung_persistent_root_is_bounded(tmp_path):
    """The exit without close() confirms run_end's durable_step by reading the persistent step's
    marker, which blocks for good: the read gives up after restore_read_timeout_s (3 s), the
    step this run committed is named durable (unconfirmed, with a warning), run_end is
    written, and every process exits 0 well within exit_timeout_s (15 s)."""
    from tests import exit_hung_script as ex

    base = str(tmp_path)
    ranks = _run_exit_script(base, "hung_marker")
    for r, (code, text, took) in enumerate(ranks):
        assert code == 0 and "terminate called" not in text, f"rank {r}: exit {code}\n{text[-4000:]}"
        assert took < ex.EXIT_TIMEOUT_S + 15, f"rank {r}: the exit took {took:.1f} s\n{text[-4000:]}"
    assert "durable unconfirmed" in ranks[0][1], ranks[0][1][-4000:]
    end = [x for x in _ledger(base) if x["kind"] == "run_end"]
    assert len(end) == 1 and end[0]["durable_step"] == 20 and end[0]["exit"] == "without close()", end


def test_exit_whose_run_end_write_hangs_leaves_within_exit_timeout(tmp_path):
    """The ledger (in the persistent root) blocks for good: the exit's close cannot append
    run_end; it is given up on within exit_timeout_s (15 s, with an error naming it), and every
    process still exits with its own status, 0."""
    from tests import exit_hung_script as ex

    base = str(tmp_path)
    ranks = _run_exit_script(base, "hung_ledger")
    for r, (code, text, took) in enumerate(ranks):
        assert code == 0 and "terminate called" not in text, f"rank {r}: exit {code}\n{text[-4000:]}"
        assert took < ex.EXIT_TIMEOUT_S + 15, f"rank {r}: the exit took {took:.1f} s\n{text[-4000:]}"
    assert "closing the engine did not finish within" in ranks[0][1], ranks[0][1][-4000:]
    assert not [x for x in _ledger(base) if x["kind"] == "run_end"]


LOADER_CFG = {"collective_timeout_s": 20}


APIS = pytest.mark.parametrize("api", ["titan", "engine"], ids=["titan-manager", "engine-api"])


@APIS
def test_loader_death_on_one_rank_only_gives_up_the_save_within_the_bound(tmp_path, api):
    """Rank 0's DataLoader workers died on the notice; rank 1 fetched its batch and is inside a
    training collective. The save is collective, so rank 0 must not start it: the agreement
    (a vote through the store, ``agree_loader_death``: the engine API's recipe and torchtitan's
    manager alike) gets no vote from rank 1 within collective_timeout_s (20 s), and rank 0
    gives the save up (a warning) and re-raises; nothing is saved, rank 1's training collective
    completes with the ranks' own values (nothing of a save paired with it), and rank 1, whose
    error is another, does not wait at all."""
    res = run_world(sh.phase_loader_death, 2, str(tmp_path), LOADER_CFG, (0,), 2, api, timeout=300)
    (saved0, took0, step0, steps0, sum0), (saved1, took1, step1, steps1, sum1) = res[0].value, res[1].value
    assert not saved0 and not saved1, res
    assert step0 == 3 and step1 == 3, res  # the trainer's step untouched: nothing saved
    assert steps0 == [] and steps1 == [], res
    assert sum0 == sum1 == 3.0, res  # 1 + 2: the training collective paired with itself only
    assert 20 - 1 <= took0 < 20 + 30, f"rank 0 decided in {took0:.1f} s"
    assert took1 < 10, f"rank 1 decided in {took1:.1f} s"


@APIS
def test_loader_death_with_another_error_elsewhere_gives_up_the_save_at_once(tmp_path, api):
    """Rank 0's fetch failed on the notice, rank 1 failed otherwise at the same time: rank 1's
    vote ("no") comes at once, so rank 0 gives the save up without waiting for the bound."""
    res = run_world(sh.phase_loader_death, 2, str(tmp_path), LOADER_CFG, (0,), 2, api, "error", timeout=300)
    for r in res:
        saved, took, step, steps, _ = r.value
        assert not saved and step == 3 and steps == [], r.value
        assert took < 10, f"rank {r.rank} decided in {took:.1f} s"


@APIS
def test_loader_death_on_every_rank_saves_the_last_finished_step(tmp_path, api):
    """Every rank's fetch failed on the notice at the same step: the agreement is immediate
    and every rank saves step 2 (the last finished one) to every tier."""
    res = run_world(sh.phase_loader_death, 2, str(tmp_path), LOADER_CFG, (0, 1), 2, api, timeout=300)
    for r in res:
        saved, took, step, steps, _ = r.value
        assert saved and step == 2 and steps == [2], r.value


def test_bounded_file_system_gives_up_on_a_file_that_blocks(tmp_path):
    """``BoundedFileSystem`` (what a bounded DCP load reads through): an ordinary file reads
    as it is, byte ranges included; a FIFO in place of a file (an open that never returns)
    raises ReadTimeout after the bound and the stuck open is left behind."""
    import threading
    import time

    from tierckpt.errors import ReadTimeout
    from tierckpt.io.bounded import BoundedFileSystem

    data = os.urandom((9 << 20) + 5)  # more than one bounded read's chunk
    ok = tmp_path / "ok.distcp"
    ok.write_bytes(data)
    fs = BoundedFileSystem(1.0)
    with fs.create_stream(ok, "rb") as f:
        assert f.read() == data
        f.seek(123)
        assert f.read(7) == data[123:130]
    fifo = str(tmp_path / "hung.distcp")
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(ReadTimeout, match="hung.distcp"):
        with fs.create_stream(fifo, "rb"):
            pass
    assert time.monotonic() - t0 < 10
    threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()  # release the helper
