"""tierckpt_dev.mcore.cpu: named, idempotent shims; nothing at all with an accelerator; the spawned
persistent async worker entry point. Each check runs in a fresh interpreter (the shims are
process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

REPO = Path(__file__).resolve().parents[2]
NAMES = ["cuda_device_to_cpu", "cuda_runtime_calls", "cuda_rng_tracker", "tensor_type_names", "async_worker"]


def _run(code: str, **env) -> str:
    e = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_apply_idempotent_named_and_effective():
    out = _run("""
        import torch, tierckpt_dev.mcore.cpu as c
        first = c.apply(); second = c.apply()
        assert first == second == c.applied(), (first, second)
        t = torch.zeros(2, device="cuda")                  # cuda_device_to_cpu
        assert t.device.type == "cpu" and torch.ones(1).cuda().device.type == "cpu"
        torch.cuda.synchronize(); assert torch.cuda.current_device() == 0   # cuda_runtime_calls
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"           # tensor_type_names
        assert torch.ones(1).type(torch.float64).dtype == torch.float64
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
        from megatron.core import parallel_state as ps
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        ps.initialize_model_parallel()
        model_parallel_cuda_manual_seed(5)                   # cuda_rng_tracker
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before)    # the default stream is untouched
        with get_cuda_rng_tracker().fork():
            b = torch.rand(3)
        assert not torch.equal(a, b)                          # the named stream advanced
        from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
        assert PersistentAsyncCaller.async_loop is c.async_worker   # spawned worker entry
        print(",".join(first))
    """)
    assert out.split(",") == NAMES


def test_skip_env_and_accelerator_noop():
    out = _run("""
        import tierckpt_dev.mcore.cpu as c
        print(",".join(c.apply()))
    """, TIERCKPT_MCORE_CPU_SKIP="tensor_type_names,async_worker")
    assert out.split(",") == [n for n in NAMES if n not in ("tensor_type_names", "async_worker")]
    out = _run("""
        import torch, tierckpt_dev.mcore.cpu as c
        orig = (torch.cuda.synchronize, torch.Tensor.type)
        c.accelerator_present = lambda: True
        assert c.apply() == [] and c.applied() == []
        assert (torch.cuda.synchronize, torch.Tensor.type) == orig
        from torch.overrides import _get_current_function_mode
        assert _get_current_function_mode() is None
        print("noop")
    """)
    assert out == "noop"
