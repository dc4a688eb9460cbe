"""The receiving side of a transfer never leaves its sender waiting, and a file that fails on
the receiver's disk is a reported problem, never a hung receive (tierckpt/transport/receive.py)."""

from __future__ import annotations

import datetime
import os
import time

import xxhash

from tests.harness import run_world
from tierckpt.io import manifest
from tierckpt.io.storage import Store

SIZES = [3 << 20, 1 << 20, 5000, 0]  # bytes; chunks of 1 MiB: 10 chunk requests in all
CHUNK = 1 << 20


def _commit_step(store: Store, rel: str) -> dict[str, bytes]:
    store.makedirs(rel)
    data, entries = {}, []
    for r, n in enumerate(SIZES):
        name = f"__{r}_0.distcp"
        data[name] = os.urandom(n)
        with store.open(f"{rel}/{name}", "wb") as f:
            f.write(data[name])
        entries.append(manifest.FileEntry(name, n, xxhash.xxh3_64(data[name]).hexdigest()))
    manifest.commit(store, rel, entries, tier="local", step=3, node=0)
    return data


def phase_transfer(rank, world, base, fault, keep):
    """Rank 0 sends its committed step to rank 1, whose receive meets ``fault``; returns
    (seconds the run took, problems, files rank 1 wrote intact)."""
    import torch.distributed as dist

    from tierckpt.transport import receive
    from tierckpt.transport.transfer import Transfer, run_transfers

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    store = Store(os.path.join(base, f"node-{rank}"))
    data = _commit_step(store, "local/step-3") if rank == 0 else None
    if rank == 1 and fault == "sink":  # a local failure before any chunk is received
        def broken(*a, **kw):
            raise ValueError("injected: sink could not be set up")

        receive._FileSink = broken
    if rank == 1 and fault == "close":  # close() reports a deferred write error for one file
        real = receive.os

        class _Os:
            def __getattr__(self, name):
                return getattr(real, name)

            @staticmethod
            def close(fd):
                path = real.readlink(f"/proc/self/fd/{fd}")
                real.close(fd)
                if path.endswith("__0_0.distcp"):
                    raise OSError(5, "injected: deferred EIO on close")

        receive.os = _Os()
    t = Transfer(src_rank=0, dst_rank=1, src_rel="local/step-3", dst_rel="incoming", tag="test")
    dist.barrier(group=group)
    t0 = time.perf_counter()
    got = run_transfers([t], rank, store, group, CHUNK, keep=keep)
    for r in got.values():
        r.finish()
    dt = time.perf_counter() - t0
    dist.barrier(group=group)
    if rank == 0:
        return dt, data
    r = got[0]
    intact = sorted(e.path for e in r.entries)
    return dt, r.problems, intact


def _run(tmp_path, fault, keep):
    return run_world(phase_transfer, 2, str(tmp_path), fault, keep, timeout=120)


def test_a_local_failure_before_receiving_drains_the_stream(tmp_path):
    # the receiver cannot set up its sink: the failure is the receive's problem, and the sender
    # finishes at once instead of waiting out the group's 60 s timeout
    out = _run(tmp_path, "sink", 0)
    send_s, recv = out[0].value[0], out[1].value
    assert send_s < 30 and recv[0] < 30, (send_s, recv)
    assert len(recv[1]) == 1 and "injected: sink could not be set up" in recv[1][0], recv
    assert recv[2] == [], recv


def test_a_failed_close_is_a_problem_of_that_file_not_a_hang(tmp_path):
    # the writer thread survives the error: the other files are written and listed intact, on
    # the streamed-to-disk path and on the kept (written afterwards) path
    for keep in (0, 64 << 20):
        out = _run(tmp_path / f"keep{keep}", "close", keep)
        dt, problems, intact = out[1].value
        assert dt < 30, dt
        assert len(problems) == 1 and "__0_0.distcp" in problems[0] and "deferred EIO" in problems[0], problems
        assert intact == ["__1_0.distcp", "__2_0.distcp", "__3_0.distcp"], intact
        data = out[0].value[1]
        node1 = Store(str(tmp_path / f"keep{keep}" / "node-1"))
        for name in intact:
            assert node1.read_bytes(f"incoming/{name}") == data[name]
