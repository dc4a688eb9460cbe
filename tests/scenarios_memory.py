"""Rank side of tests/test_restore_memory.py: a node restored from a peer's replica loads the
pulled bytes from memory, and its copy is written and committed afterwards in the background."""

from __future__ import annotations

import logging
import os

import torch

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt.engine import TieredCheckpointer
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.fallbacks = 0
        self.no_memory = 0

    def emit(self, record):
        if "from memory failed" in record.getMessage():
            self.fallbacks += 1
        if "no memory to keep" in record.getMessage():
            self.no_memory += 1


def phase_node_loss(rank, world, base, rpn, k, extra_steps, cfg_kw=None, drop_metadata=False, no_memory=False):
    """Restore step ``k`` after node 1 lost its root (the caller deleted it); check the state
    and the next losses bitwise against the uninterrupted run, then, once the background job
    ran, that node 1 holds a committed, intact copy of step ``k`` of its own again.
    ``no_memory``: node 1's allocator refuses the buffers of a kept receive."""
    if no_memory and rank // rpn == 1:
        from tierckpt.transport import receive

        def refuse(size):
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {size} bytes")

        receive._aligned = refuse
    if drop_metadata:  # the receiving rank "forgets" .metadata after the pull: the load must fall back
        from tierckpt.restore import pull

        run = pull.run_pulls

        def forgetful(*a, **kw):
            out = run(*a, **kw)
            out.memory.pop(".metadata", None)
            return out

        pull.run_pulls = forgetful
        from tierckpt.restore import restorer

        restorer.run_pulls = forgetful
    count = _Count()
    logging.getLogger("tierckpt.restore.restorer").addHandler(count)
    logging.getLogger("tierckpt.restore.restorer").setLevel(logging.INFO)
    logging.getLogger("tierckpt.transport.receive").addHandler(count)
    node = rank // rpn
    eng = TieredCheckpointer(make_config(base, **(cfg_kw or {})), node_id=node)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)
    sd = app_state(model, opt)
    res = eng.restore(sd)
    assert res is not None
    apply_state(model, opt, sd)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    losses = [train_step(model, opt, s, rank) for s in range(k + 1, k + 1 + extra_steps)]
    assert losses == ref["losses"], f"losses {losses} != reference {ref['losses']}"
    red = eng.last_redundancy.result() if eng.last_redundancy is not None else None
    eng.wait()
    store = Store(os.path.join(base, "nvme", f"node-{node}"))
    doc = manifest.read_committed(store, layout.local_step(k))
    out = {
        "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
        "attempts": res.attempts,
        "fallbacks": count.fallbacks,
        "no_memory": count.no_memory,
        "own_copy": None if doc is None else (doc.get("node"), manifest.verify_step(store, layout.local_step(k))),
        "incoming_left": store.exists(layout.incoming_step(k)),
        "redundancy": None if red is None else (red.ok, red.nodes, red.missing),
    }
    eng.close()
    return out


def phase_own_load_overlaps_check(rank, world, base, rpn, k, extra_steps, cfg_kw=None):
    """:func:`~tests.scenarios.phase_restore_and_check`, recording for each checksum pass over
    this rank's own copy whether the load from its mappings had already started (waiting up to
    20 s for it): the load must not wait for the checksums."""
    import threading

    from tests.scenarios import phase_restore_and_check
    from tierckpt.io import memory_read

    started = threading.Event()
    seen: list[bool] = []
    read_data, check_share = memory_read.MemoryReader.read_data, memory_read.check_share

    def reading(self, plan, planner):
        started.set()
        return read_data(self, plan, planner)

    def checking(*a):
        seen.append(started.wait(20))
        return check_share(*a)

    memory_read.MemoryReader.read_data = reading
    memory_read.check_share = checking
    out = phase_restore_and_check(rank, world, base, rpn, k, extra_steps, cfg_kw)
    return {**out, "load_before_check": seen}


def phase_own_copy_read_two_ways(rank, world, base, rpn, k, extra_steps, cfg_kw=None, disk_error=False):
    """:func:`~tests.scenarios.phase_restore_and_check` where local rank 1 of every node does not
    read its share of the own copy ahead (checksummed from disk before its load, as a share
    above ``restore_memory_bytes`` is) while local rank 0 does; ``disk_error``: node 0's local
    rank 1 gets an I/O error while checksumming. Adds ``reads``: how many times DCP's file
    reader ran ``read_data`` on this rank (0 for a copy refused before decoding)."""
    from tests.scenarios import phase_restore_and_check
    from tierckpt.io import dcp_io
    from tierckpt.restore import restorer

    if rank % rpn == 1:
        class NotReadAhead(restorer.OwnRead):
            def __init__(self, *a, **kw):
                self.started = False

        restorer.OwnRead = NotReadAhead
        if disk_error and rank // rpn == 0:
            def unreadable(*a, **kw):
                raise OSError(5, "Input/output error")

            restorer.verify_split = unreadable
    reads = [0]
    read_data = dcp_io.CountingFileSystemReader.read_data

    def counting(self, plan, planner):
        reads[0] += 1
        return read_data(self, plan, planner)

    dcp_io.CountingFileSystemReader.read_data = counting
    out = phase_restore_and_check(rank, world, base, rpn, k, extra_steps, cfg_kw)
    return {**out, "reads": reads[0]}


# -- every dtype, whatever its offset in the file (tests/test_restore_dtypes.py) -------------------
DTYPES = ("float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128", "int8", "int16",
          "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
          "bcomplex32")  # only the names the running torch has are used (bcomplex32: torch >= 2.15)
ODD = (1, 3, 7)  # elements of the int8 neighbour before each tensor, and of the tensor itself


def dtype_state(rank: int, seed: int) -> dict:
    """{"r<rank>": {...}}: for every dtype of :data:`DTYPES` torch has, tensors of 1, 3 and 7
    elements, each right after an int8 tensor of an odd number of elements (DCP writes a
    rank's records back to back in state order, so their data lands at offsets of every
    residue). Random bytes (valid booleans); keys differ per rank (the persistent tier holds
    every rank's). ``seed`` 0 gives zeros (a target to load into)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out: dict[str, torch.Tensor] = {}
    for name in DTYPES:
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        size = torch.empty(0, dtype=dt).element_size()
        for j, n in enumerate(ODD):
            pad = ODD[(j + 1) % len(ODD)]
            if dt == torch.bool:
                raw = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8)
            else:
                raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
            out[f"{name}.pad{j}"] = torch.randint(-128, 128, (pad,), generator=g, dtype=torch.int8)
            out[f"{name}.x{j}"] = (raw if seed else torch.zeros_like(raw)).view(dt)
    return {f"r{rank}": out}


def phase_every_dtype_every_source(rank, world, base):
    """Save :func:`dtype_state` to every tier, then restore it three times into zeros: every
    node from its own copy; node 1 (root deleted) from node 0's replica; node 1 (root and its
    replicas deleted) from the persistent tier; bitwise per dtype each time, with the default
    ``restore_memory_bytes`` (own and pulled copies decoded from memory). Returns the sources
    of node 1 and the dtypes loaded."""
    import shutil

    import torch.distributed as dist

    eng = TieredCheckpointer(make_config(base), node_id=rank)
    eng.save(1, dtype_state(rank, 1))
    eng.wait()
    ref = dtype_state(rank, 1)
    seen = []
    for wipe in ("none", "node", "node+replicas"):
        eng.wait()  # the replica rebuild of the last restore must not write into a root wiped next
        dist.barrier()
        if rank == 0 and wipe != "none":
            shutil.rmtree(os.path.join(base, "nvme", "node-1"), ignore_errors=True)
            if wipe == "node+replicas":
                shutil.rmtree(os.path.join(base, "nvme", "node-0", "replicas", "node-1"), ignore_errors=True)
        dist.barrier()
        sd = dtype_state(rank, 0)
        res = eng.restore(sd)
        assert res is not None and res.step == 1, res
        assert_bitwise(sd, ref)
        seen.append((res.source_of(0), res.source_of(1)))
    eng.close()
    return {"sources": seen, "dtypes": sorted({str(t.dtype) for t in ref[f"r{rank}"].values()})}


# -- host memory of replication and of a restore (tests/test_transfer_memory.py) ----------------
MiB = 1 << 20


def host_bytes() -> dict[str, int]:
    """This process's resident anonymous and shared-anonymous memory (bytes): what the heap,
    torch's allocator and the transfer buffers (anonymous shared mappings) take; page-cache
    mappings of files (reclaimable) are not counted."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler:
    """Samples :func:`host_bytes` (anon + shmem) every 2 ms on a thread; :meth:`stop` returns
    the peak seen (bytes). A transfer buffer or a kept share stays resident for the whole
    transfer (hundreds of samples): a sampler cannot miss it."""

    def __init__(self):
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            b = host_bytes()
            self.peak = max(self.peak, b["RssAnon"] + b["RssShmem"])
            if self._stop.wait(0.002):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def big_state(rank: int, seed: int, mib: int, tensors: int) -> dict:
    """{"r<rank>": {"t<i>": float32 tensor}}: ``tensors`` tensors, ``mib`` MiB in all; seed 0: zeros."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    n = mib * MiB // 4 // tensors
    return {f"r{rank}": {f"t{i}": torch.rand(n, generator=g) if seed else torch.zeros(n) for i in range(tensors)}}


def phase_memory_save(rank, world, base, cfg_kw, mib, tensors):
    """Save :func:`big_state` to the local tier (replicated to the peer node) and wait. Returns
    {"shmem_after": RssShmem growth after the replication ended (bytes), "peak": anon+shmem
    growth during the save (bytes)}."""
    eng = TieredCheckpointer(make_config(base, tiers=("local",), **cfg_kw), node_id=rank)
    sd = big_state(rank, 1, mib, tensors)
    before = host_bytes()
    sampler = PeakSampler()
    eng.save(1, sd)
    eng.wait()
    peak = sampler.stop()
    after = host_bytes()
    eng.close()
    return {"shmem_after": after["RssShmem"] - before["RssShmem"],
            "peak": peak - before["RssAnon"] - before["RssShmem"]}


def phase_memory_restore(rank, world, base, cfg_kw, mib, tensors):
    """Restore :func:`big_state` into zeros (node 1's root was deleted: a pull from node 0's
    replica), bitwise. Returns this rank's source, the peak growth of anon+shmem memory during
    ``restore()`` over the memory before it (the state already allocated), and the RssShmem
    growth left once the background commit and replica rebuild ended (bytes)."""
    import gc

    eng = TieredCheckpointer(make_config(base, tiers=("local",), **cfg_kw), node_id=rank)
    sd = big_state(rank, 0, mib, tensors)
    gc.collect()
    before = host_bytes()
    sampler = PeakSampler()
    res = eng.restore(sd)
    peak = sampler.stop()
    assert res is not None and res.step == 1
    eng.wait()
    after = host_bytes()
    assert_bitwise(sd, big_state(rank, 1, mib, tensors))
    out = {"source": res.source_of(rank), "peak": peak - before["RssAnon"] - before["RssShmem"],
           "shmem_after": after["RssShmem"] - before["RssShmem"]}
    eng.close()
    return out
