"""Helpers shared by ``bench/bench_peers.py`` (main venv) and ``bench/peers_lmr.py`` (side venv).

Only the standard library and torch are imported here: the side virtualenv ``.venv-peers`` has
no tierckpt, rich or xxhash.
"""

from __future__ import annotations

import os
import statistics

MiB = 1 << 20
N_LARGE, N_SMALL, N_SCALAR = 4, 280, 40


def make_state(rank: int, mib: float, seed: int = 1234) -> dict:
    """The benchmark state of one rank: 324 CPU tensors, about ``mib`` MiB.

    4 large fp32 tensors hold 3/4 of the bytes, 280 small fp32 tensors the rest, plus 40 int64
    0-dim scalars (8 bytes each). Keys are rank-unique (``r<rank>.…``): DCP treats a plain tensor
    with the same key on several ranks as replicated and would write rank 0's copy only.

    Args:
        rank: global rank (seeds the values and prefixes the keys).
        mib: state size per rank in MiB (2**20 bytes); at least 1.
    Returns:
        ``{key: tensor}``; values from ``torch.randn`` / ``torch.randint`` with a per-rank seed.
    Raises:
        ValueError: ``mib`` too small for one fp32 element per small tensor.
    """
    import torch

    total = int(mib * MiB)
    large_el = (total * 3 // 4) // (4 * N_LARGE)
    small_el = (total - N_LARGE * large_el * 4 - 8 * N_SCALAR) // (4 * N_SMALL)
    if large_el < 1 or small_el < 1:
        raise ValueError(f"mib={mib} is too small for {N_LARGE + N_SMALL} fp32 tensors")
    gen = torch.Generator().manual_seed(seed + rank)
    sd: dict = {}
    for i in range(N_LARGE):
        sd[f"r{rank}.large{i}"] = torch.randn(large_el, generator=gen, dtype=torch.float32)
    for i in range(N_SMALL):
        sd[f"r{rank}.small{i}"] = torch.randn(small_el, generator=gen, dtype=torch.float32)
    for i in range(N_SCALAR):
        sd[f"r{rank}.scalar{i}"] = torch.randint(0, 1 << 40, (), generator=gen, dtype=torch.int64)
    return sd


def state_bytes(sd: dict) -> int:
    """Bytes of tensor data in ``sd``."""
    return sum(t.numel() * t.element_size() for t in sd.values())


def mutate(sd: dict, step: int) -> None:
    """Make ``sd`` depend on ``step`` in place, so a restore of another step fails the check.

    Writes ``step`` into the first scalar and the first small tensor (a few KiB: negligible
    next to the state).
    """
    rank_prefix = next(iter(sd)).split(".", 1)[0]
    sd[f"{rank_prefix}.scalar0"].fill_(step)
    sd[f"{rank_prefix}.small0"].fill_(float(step))


def snapshot(sd: dict) -> dict:
    """A deep copy of ``sd`` (the expected values of a later restore)."""
    return {k: v.clone() for k, v in sd.items()}


def bitwise_mismatches(expected: dict, got: dict) -> list[str]:
    """Every difference between two state dicts, compared byte for byte.

    Keys, dtypes and shapes must match and each tensor's bytes must be identical (a NaN with the
    same bit pattern counts as equal, ``-0.0`` and ``0.0`` do not).

    Returns:
        one line per difference; empty when the dicts are bitwise equal.
    """
    import torch

    out = []
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing:
        out.append(f"missing keys: {missing[:5]}{' …' if len(missing) > 5 else ''}")
    if extra:
        out.append(f"unexpected keys: {extra[:5]}{' …' if len(extra) > 5 else ''}")
    for k in sorted(set(expected) & set(got)):
        a, b = expected[k], got[k]
        if not isinstance(b, torch.Tensor):
            out.append(f"{k}: not a tensor ({type(b).__name__})")
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {b.dtype}{tuple(b.shape)} != expected {a.dtype}{tuple(a.shape)}")
            continue
        ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ab, bb):
            n = int((ab != bb).sum())
            out.append(f"{k}: {n} byte(s) differ")
    return out


def assert_bitwise(expected: dict, got: dict, what: str) -> None:
    """Raise if ``got`` is not bitwise equal to ``expected``.

    Raises:
        AssertionError: naming ``what`` and the first differences.
    """
    bad = bitwise_mismatches(expected, got)
    if bad:
        raise AssertionError(f"{what}: restored state is not bitwise equal to the saved state: "
                             + "; ".join(bad[:5]))


def drop_page_cache(root: str) -> int:
    """fsync then ``POSIX_FADV_DONTNEED`` every file under ``root``; returns the file count.

    Without this a restore right after a save reads the page cache, not the disk. Files on tmpfs
    (/dev/shm) stay in memory: the advice is a no-op there, as it should be for a RAM tier.
    """
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                try:
                    os.fsync(fd)
                except OSError:
                    pass
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size (bytes) of ``pid`` (default: this process) plus all its descendants.

    Descendants count because DCP's process executor keeps its staged copy and writer in a
    child process. Source: ``VmRSS`` of /proc/<pid>/status (kB). Shared-memory pages mapped by
    several of these processes are counted once per process.
    """
    pid = os.getpid() if pid is None else pid
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
        todo += _children(p)
    return total


def abba(names: list[str], reps: int) -> list[list[str]]:
    """Per repetition, the order of ``names``: forward, then reversed, alternating (A B … B A)."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(reps)]


def med(xs) -> float:
    """Median, NaN for an empty list."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def gmax(x: float) -> float:
    """``x`` (seconds, bytes) reduced to its maximum over the default process group: the slower
    rank's value, the same on every rank (collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
