"""What fresh host memory costs on this machine, against writing memory already mapped.

A restore that receives a replica into memory, or a ``torch.load``, writes into pages the
process never touched: each page is allocated and zeroed by the kernel on first touch (in a
VM, also backed by the host). This probe times, each in a fresh interpreter (nothing reused
from an earlier allocation), ``--mib`` MiB made resident three ways — ``torch.empty`` +
``zero_()`` (what a pull's receive buffers get), ``madvise(MADV_POPULATE_WRITE)`` (the kernel
populates without a user pass; Linux ≥ 5.14) and an anonymous ``mmap`` with ``MAP_POPULATE`` —
and, in the same interpreter, one ``fill_`` of the now-resident memory (a memcpy-class write),
and prints medians and the ratio first touch ÷ rewrite.

    .venv/bin/python bench/probe_memory.py --mib 256 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import ctypes, json, mmap, sys, time, torch
torch.set_num_threads(1)
n, kind = int(sys.argv[1]) << 20, sys.argv[2]
t0 = time.perf_counter()
if kind == "zero_":
    t = torch.empty(n, dtype=torch.uint8); t.zero_()
elif kind == "MADV_POPULATE_WRITE":
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -raw.data_ptr() % 4096
    if libc.madvise(raw.data_ptr() + start, n, 23):  # 23 = MADV_POPULATE_WRITE
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
    t = raw[start: start + n]
else:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    t = torch.frombuffer(m, dtype=torch.uint8)
t1 = time.perf_counter()
t.fill_(1)
print(json.dumps({"first": t1 - t0, "rewrite": time.perf_counter() - t1}))
"""

KINDS = ("zero_", "MADV_POPULATE_WRITE", "MAP_POPULATE")


def main() -> None:
    """Parse the options (``--mib`` > 0, ``--reps`` > 0, else exit 2 naming them), run every
    method ``--reps`` times interleaved, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per measurement (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="fresh interpreters per method (default 3)")
    a = ap.parse_args()
    if a.mib <= 0 or a.reps <= 0:
        ap.error("--mib and --reps must be positive integers")
    rows: dict[str, dict[str, list[float]]] = {k: {"first": [], "rewrite": []} for k in KINDS}
    for _ in range(a.reps):
        for k in KINDS:  # interleaved, so load drifts hit every method alike
            out = subprocess.run([sys.executable, "-c", _CHILD, str(a.mib), k], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            for key, v in json.loads(out).items():
                rows[k][key].append(v)
    print(f"{a.mib} MiB, median of {a.reps} fresh interpreters each")
    print(f"{'method':<22}{'first touch s':>14}{'rewrite s':>11}{'ratio':>8}")
    for k, r in rows.items():
        f, w = statistics.median(r["first"]), statistics.median(r["rewrite"])
        print(f"{k:<22}{f:>14.4f}{w:>11.4f}{f / w:>8.1f}")


if __name__ == "__main__":
    main()
