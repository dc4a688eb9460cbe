"""Measurement 4 of bench/bench_peers.py: what one save costs a CPU-bound trainer.

The δ rows model an accelerator trainer: the host thread is idle during forward/backward, so a
background copy (overlapped staging, DCP's async staging) runs for free. On a CPU trainer the
same cores compute the step, and everything a save starts — the overlapped copy, serialisation,
checksums, writes, replication — competes with it. This measures the whole of it as training
time lost.

The trainer, per step: a forward/backward of ``window`` seconds of fp32 matmuls on the rank's
torch threads (calibrated alone, both ranks computing at once), then the optimizer's part: the
system's wait for staging (:meth:`before_update`; tierckpt's ``wait_for_staging()``, DCP's
``staging_completion``) and one in-place add over every floating tensor of the state (an
optimizer writes every parameter and moment). One sample of a system:

1. ``steps`` steps without a save: mean step time ``b`` (seconds);
2. a save at the start of a run of ``n`` steps, ``n >= steps`` and until the save's background
   work is done (the system's :meth:`busy`): elapsed ``T``;
3. cost = ``T - n·b`` (seconds, slower rank): the call, the waits, the slower compute.

What the system does after it reports done (``complete()``) is timed separately as the tail
(not in the cost; tierckpt's handle resolves after the replica is committed, so it is ~0).
"""
from __future__ import annotations

import time

from peers_common import abba, gmax, mutate

MATMUL_N = 256  # 2·256³ flop per product: about a millisecond on one core


class Work:
    """The modelled forward/backward: ``iters`` products of two ``MATMUL_N``² fp32 matrices,
    ``iters`` calibrated so that one call takes ``window_s`` seconds with both ranks computing
    (and nothing else running). Collective (barrier) at construction."""

    def __init__(self, window_s: float, barrier, calib_s: float = 0.5):
        import torch

        g = torch.Generator().manual_seed(7)
        self.a = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        self.b = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        self.c = torch.empty(MATMUL_N, MATMUL_N)
        for _ in range(20):  # warm the BLAS path before timing it
            torch.mm(self.a, self.b, out=self.c)
        barrier()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < calib_s:
            torch.mm(self.a, self.b, out=self.c)
            n += 1
        rate = n / (time.perf_counter() - t0)
        self.iters = max(1, round(window_s * rate))

    def __call__(self) -> None:
        import torch

        for _ in range(self.iters):
            torch.mm(self.a, self.b, out=self.c)


def step_cost(systems: dict, names: list[str], sd: dict, *, reps: int, steps: int, window_s: float,
              barrier, first_step: int) -> dict:
    """Run measurement 4 on this rank (collective: every rank calls it with the same arguments).

    Args:
        systems: name → system object with ``begin(sd, step)``, ``before_update()``, ``busy()``
            and ``complete()`` (bench_peers' ``Tier`` and ``Dcp``), warmed up (both of
            tierckpt's staging buffers allocated).
        names: the systems to measure, in ABBA order over ``reps`` repetitions.
        sd: the benchmark state (modified in place: the modelled optimizer adds to it).
        steps: the minimum steps per run (>= 1).
        window_s: forward/backward per step, seconds.
        first_step: the first checkpoint step number to use.
    Returns:
        ``{"cost_s": {name: [s]}, "base_step_s": {name: [s]}, "steps": {name: [n]},
        "tail_s": {name: [s]}, "matmuls_per_step": int, "next_step": int}`` — the slower rank's
        value per sample; ``next_step`` is the first checkpoint step number not used.
    """
    import torch

    work = Work(window_s, barrier)
    floats = [v for v in sd.values() if v.is_floating_point()]
    step = first_step

    def run(system=None) -> tuple[float, int]:
        barrier()
        t0 = time.perf_counter()
        if system is not None:
            mutate(sd, step)
            system.begin(sd, step)
        n = 0
        while n < steps or (system is not None and system.busy()):
            work()
            if system is not None:
                system.before_update()
            torch._foreach_add_(floats, 1.0)
            n += 1
        return time.perf_counter() - t0, n

    out: dict = {k: {n: [] for n in names} for k in ("cost_s", "base_step_s", "steps", "tail_s")}
    out["matmuls_per_step"] = work.iters
    for order in abba(names, reps):
        for name in order:
            tb, nb = run()
            b = tb / nb
            t, n = run(systems[name])
            t0 = time.perf_counter()
            systems[name].complete()
            tail = time.perf_counter() - t0
            step += 1
            out["cost_s"][name].append(gmax(t - n * b))
            out["base_step_s"][name].append(gmax(b))
            out["steps"][name].append(int(gmax(float(n))))
            out["tail_s"][name].append(gmax(tail))
    out["next_step"] = step
    return out
