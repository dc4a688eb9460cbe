"""Host memory of replication and of a restore (issue 29 E.7; docs/design.md, "Host memory").

- a replication's chunk buffers are released when it ends: after a save replicated 96 MiB
  with 128 MiB chunks, no rank keeps shared-anonymous memory (the buffers were pinned for the
  life of the process before);
- a restore whose pull does not fit ``restore_memory_bytes`` (16 MiB; 96 MiB share, 128 MiB
  chunks) receives it to disk in chunks capped so its buffers stay within the bound: the
  receiving rank's measured peak (anon + shmem, sampled) stays under
  ``restore_memory_bytes + 2 × the largest record + slack`` (it was the whole share, +100 MiB);
  a pull that fits is kept in memory within the same bound; after the background commit and
  the replica rebuild, no buffer is left;
- units: the pull chunk size, and a :class:`~tierckpt.transport.wire.BufferPool` unmapping its
  buffers on release (only once no request holds them).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests import scenarios_memory
from tests.harness import run_world
from tierckpt.restore.pull import pull_chunk_bytes
from tierckpt.transport import wire

MiB = 1 << 20
STATE_MIB, TENSORS = 96, 24  # per rank, in records of 4 MiB
RECORD = STATE_MIB * MiB // TENSORS
CHUNK = 128 << 20  # transfer_chunk_bytes: above the share, as the 256 MiB was
SLACK = 24 * MiB  # allocator noise (glibc keeps some freed chunks), the sampler thread, logging
LEFT = 4 * MiB  # shared-anonymous memory a rank may keep after its transfers ended


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hostmem"))
    out = run_world(scenarios_memory.phase_memory_save, 2, base, {"transfer_chunk_bytes": CHUNK}, STATE_MIB,
                    TENSORS, timeout=300)
    return base, [r.value for r in out]


def test_replication_releases_its_chunk_buffers(saved):
    _, out = saved
    for v in out:
        # the receive used its buffers (the peak holds the staging copy and the received share)
        assert v["peak"] >= 1.5 * STATE_MIB * MiB, v
        assert v["shmem_after"] <= LEFT, f"{v['shmem_after'] / MiB:.0f} MiB of chunk buffers kept after replication"


@pytest.mark.parametrize("memory_mib", [16, 128], ids=["share-above-bound", "share-kept"])
def test_restore_peak_stays_within_restore_memory_bytes(saved, tmp_path, memory_mib):
    base = str(tmp_path / "run")
    shutil.copytree(saved[0], base)
    shutil.rmtree(os.path.join(base, "nvme", "node-1"))
    cfg = {"transfer_chunk_bytes": CHUNK, "restore_memory_bytes": memory_mib * MiB}
    out = [r.value for r in run_world(scenarios_memory.phase_memory_restore, 2, base, cfg, STATE_MIB, TENSORS,
                                      timeout=300)]
    assert [v["source"] for v in out] == ["own-local", "peer-replica"], out
    bound = memory_mib * MiB + 2 * RECORD + SLACK  # docs/design.md, "Host memory"
    got = out[1]["peak"]
    assert got <= bound, f"receiving rank's peak +{got / MiB:.0f} MiB > bound {bound / MiB:.0f} MiB"
    for v in out:  # the pull's and the rebuild's buffers are gone
        assert v["shmem_after"] <= LEFT, out


def test_pull_chunk_bytes_caps_the_receive_buffers_by_the_restore_bound():
    assert pull_chunk_bytes(256 * MiB, 32 << 30) == 256 * MiB  # the default bound: transfer_chunk_bytes
    assert pull_chunk_bytes(256 * MiB, 64 * MiB) == 16 * MiB  # 4 buffers = the bound
    assert pull_chunk_bytes(256 * MiB, 64 * MiB + 5) == 16 * MiB  # a multiple of 4096
    assert pull_chunk_bytes(256 * MiB, 0) == 1 * MiB  # restore from disk: 4 MiB of buffers
    assert pull_chunk_bytes(8192, 64 * MiB) == 8192  # never above transfer_chunk_bytes
    for m in (0, 4097, 10 * MiB + 3, 1 << 30):
        assert pull_chunk_bytes(64 * MiB, m) % 4096 == 0


def test_buffer_pool_unmaps_on_release_once_no_request_holds_a_buffer():
    start = wire.live_buffer_bytes()
    pool = wire.BufferPool()
    a = pool.get("recv", 1 << 20, 4)
    assert pool.get("recv", 1 << 20, 4) is a and len(a) == 4  # reused within the batch
    assert wire.live_buffer_bytes() - start == 4 << 20
    held = a[1][:100]  # a request in flight still uses this buffer
    held.fill_(7)
    del a
    pool.release()
    assert wire.live_buffer_bytes() - start == 1 << 20, "a buffer in use was unmapped (or none was)"
    assert int(held.sum()) == 700
    del held
    assert wire.live_buffer_bytes() == start
    pool.release()  # idempotent
    assert pool.get("send", 4096, 2)[0].numel() == 4096
    pool.release()
    assert wire.live_buffer_bytes() == start
