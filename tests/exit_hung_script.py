"""One rank of tests/test_hung_edges.py's exit tests, run as its own process (``python -m
tests.exit_hung_script BASE MODE``, torchrun's environment): save step 20 to every tier
(waited for), make the persistent root hang, then leave *without* ``close()`` through the
interpreter's normal exit, which confirms ``durable_step`` and appends ``run_end`` there.
MODE: ``hung_marker`` (a FIFO in place of step 20's commit marker: confirming the step blocks),
``hung_ledger`` (opening the ledger never returns: appending ``run_end`` blocks). Prints
``LEAVING <time.time()>`` when ``main`` returns, so the test can time the exit itself.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from tests import scenarios
from tierckpt.engine import TieredCheckpointer

EXIT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 3.0


def main() -> None:
    base, mode = sys.argv[1], sys.argv[2]
    assert mode in ("hung_marker", "hung_ledger"), mode
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = scenarios.make_config(base, exit_timeout_s=EXIT_TIMEOUT_S, restore_read_timeout_s=READ_TIMEOUT_S)
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = scenarios.build(seed=0)
    for s in range(1, 21):
        scenarios.train_step(model, opt, s, rank)
    eng.save(20, scenarios.app_state(model, opt))
    eng.wait(bounded=False)
    dist.barrier()
    if rank == 0 and mode == "hung_marker":  # the shared file system stops answering
        marker = os.path.join(base, "pfs", "step-20", "tierckpt.committed")
        os.remove(marker)
        os.mkfifo(marker)  # a read of it blocks for good
    if rank == 0 and mode == "hung_ledger":  # the ledger's open never returns (a FIFO would not block: "a+b")
        import builtins
        import threading

        ledger, real_open = os.path.join(base, "pfs", "tierckpt-ledger.jsonl"), builtins.open

        def hanging_open(file, *a, **kw):
            if isinstance(file, str) and os.path.abspath(file) == os.path.abspath(ledger):
                threading.Event().wait()
            return real_open(file, *a, **kw)

        builtins.open = hanging_open
    dist.barrier()
    print(f"LEAVING {time.time():.3f}", flush=True)
    # no close(): the interpreter's exit finishes the engine


if __name__ == "__main__":
    main()
