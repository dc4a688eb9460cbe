"""A slot's first save of a state of plain CPU tensors (tierckpt/staging/copy_plan.py
``allocate_like``): the host copy is allocated and filled by the copy plan, not deep-copied by
DCP's stager, and holds what DCP's copy would: the same containers, dtypes, shapes and bits,
isolated from the live state. Any other kind of leaf still goes through DCP's stager."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch

from tierckpt.staging.pool import StagingPool


def _no_dcp_copy(slot):
    def refuse(sd):
        raise AssertionError("DCP's stager was called on a state allocate_like takes")
    slot.stager.stage = refuse


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _state() -> dict:
    base = torch.arange(24.0)
    nan = torch.tensor([float("nan"), -0.0, 1.0]).view(torch.int32)
    nan[0] |= 0x1234  # a NaN payload: bits, not values, must survive
    return {
        "model": OrderedDict((f"w{i}", torch.randn(3, 4)) for i in range(3)),
        "perm": torch.randn(4, 6).t(),                  # dense, permuted: strides kept
        "view": base[::3],                               # a view with gaps: own, exact-size storage
        "nan": nan.view(torch.float32),
        "c128": torch.randn(5, dtype=torch.complex128)[1:],  # unaligned in its source storage
        "bf16": torch.randn(7).to(torch.bfloat16),
        "flag": torch.tensor([True, False]),
        "param": torch.nn.Parameter(torch.ones(2)),
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, torch.tensor(0.95)), "params": [0, 1]}]},
        "step": 10, "name": "run", "dtype": torch.float16,
    }


def _leaves(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, x


def test_first_save_allocates_and_fills_the_copy_bit_for_bit():
    slot = StagingPool(1).acquire()
    _no_dcp_copy(slot)
    live = _state()
    staged = slot.stage(live, users=1)
    assert type(staged["model"]) is OrderedDict and list(staged["model"]) == ["w0", "w1", "w2"]
    assert type(staged["optim"]["param_groups"][0]["betas"]) is tuple
    for (path, a), (path_b, b) in zip(_leaves(live), _leaves(staged), strict=True):
        assert path == path_b
        if isinstance(a, torch.Tensor):
            assert type(b) is torch.Tensor and b.dtype == a.dtype and b.shape == a.shape, path
            assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr(), path
            assert b.untyped_storage().nbytes() == b.nbytes, f"{path}: the writer would clone a view"
            assert torch.equal(_bits(a), _bits(b)), path
        else:
            assert b is a, path  # immutable scalars are shared
    assert staged["perm"].stride() == live["perm"].stride()
    assert not staged["param"].requires_grad
    for _, t in _leaves(live):
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            t.detach().mul_(2)  # training goes on: the copy does not move
    assert torch.equal(_bits(staged["model"]["w1"] * 2), _bits(live["model"]["w1"]))
    assert slot._plan is not None and "model.w1" in slot._plan.names


def test_the_allocated_copy_takes_the_plan_from_the_second_save_on():
    slot = StagingPool(1).acquire()
    live = _state()
    first = slot.stage(live, users=1)
    _no_dcp_copy(slot)
    live["model"]["w0"].fill_(3.0)
    live["optim"]["param_groups"][0]["lr"] = 0.5
    second = slot.stage(live, users=1)
    assert second is first and second["optim"]["param_groups"][0]["lr"] == 0.5
    assert torch.equal(second["model"]["w0"], torch.full((3, 4), 3.0))


def test_a_changed_value_inside_a_tuple_allocates_a_new_copy():
    slot = StagingPool(1).acquire()
    live = {"w": torch.ones(2), "g": (0.9, 0.95)}
    first = slot.stage(live, users=1)
    live["g"] = (0.8, 0.95)
    second = slot.stage(live, users=1)
    assert second is not first and second["g"] == (0.8, 0.95) and first["g"] == (0.9, 0.95)


def test_dtensors_keep_their_spec():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from tests.harness import free_port

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        slot = StagingPool(1).acquire()
        _no_dcp_copy(slot)
        staged = slot.stage({"w": w, "tied": (w, 3)}, users=1)
        for s in (staged["w"], staged["tied"][0]):
            assert type(s) is DTensor and s._spec == w._spec
            assert torch.equal(s.to_local(), w.to_local())
            assert s.to_local().data_ptr() != w.to_local().data_ptr()
        w.to_local().add_(1)
        assert staged["w"].to_local()[0].item() == 0.0
    finally:
        if owned:
            dist.destroy_process_group()  # the other tests of this process expect none


@dataclasses.dataclass
class _Pos:
    rows: list


def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("odd", [lambda: _Pos([1]), _quantized], ids=["object", "quantized"])
def test_other_leaves_go_through_dcps_stager(odd):
    slot = StagingPool(1).acquire()
    called = []
    real = slot.stager.stage
    slot.stager.stage = lambda sd: called.append(1) or real(sd)
    slot.stage({"w": torch.ones(2), "odd": odd()}, users=1)
    assert called == [1]
