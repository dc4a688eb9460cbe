"""The staging slot's copy plan (tierckpt/staging/copy_plan.py): from the second save of one structure on, a slot refills its
last staged copy instead of deep-copying through DCP's stager. Every case asserts the staged
values equal the live ones at the time of the call and stay isolated from later changes."""

from __future__ import annotations

import dataclasses

import torch

from tierckpt.staging.pool import StagingPool


def _state(scale: float = 1.0) -> dict:
    return {
        "model": {f"w{i}": torch.full((3, 4), scale * i) for i in range(5)},
        "optim": {"state": {0: {"step": torch.tensor(7.0 * scale), "exp_avg": torch.arange(6.0) * scale}},
                  "param_groups": [{"lr": 0.1 * scale, "betas": (0.9, 0.95), "params": [0]}]},
        "ints": torch.arange(4, dtype=torch.int64) * int(scale),
        "step": int(scale * 10),
        "name": "run",
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _stage(slot, sd):
    return slot.stage(sd, users=1)


def test_second_stage_refills_the_same_copy_with_new_values():
    slot = StagingPool(1).acquire()
    live = _state(1.0)
    first = _stage(slot, live)
    assert _same(first, live)
    for k in live["model"]:  # training goes on after save() returned
        live["model"][k].add_(100)
    live["optim"]["param_groups"][0]["lr"] = 0.5
    live["step"] = 11
    assert first["model"]["w1"][0, 0].item() == 1.0 and first["step"] == 10  # the copy did not move
    second = _stage(slot, live)
    assert second is first, "same structure: the slot's copy is refilled, not rebuilt"
    assert _same(second, live)
    assert second["model"]["w1"].data_ptr() != live["model"]["w1"].data_ptr()
    live["ints"].add_(5)
    assert second["ints"].tolist() == [0, 1, 2, 3]


def test_structure_changes_fall_back_to_a_full_copy():
    slot = StagingPool(1).acquire()
    live = _state(1.0)
    _stage(slot, live)
    changes = [
        lambda s: s["model"].update(extra=torch.ones(2)),                 # new key
        lambda s: s["model"].__setitem__("w0", torch.zeros(4, 4)),          # new shape
        lambda s: s.__setitem__("ints", s["ints"].to(torch.int32)),          # new dtype
        lambda s: s["optim"]["param_groups"][0]["params"].append(1),        # list length
        lambda s: s["optim"]["param_groups"][0].__setitem__("betas", (0.8, 0.95)),  # a value in a tuple
    ]
    for change in changes:
        change(live)
        staged = _stage(slot, live)
        assert _same(staged, live)
        again = _stage(slot, live)
        assert again is staged and _same(again, live)  # the new structure gets its own plan


def test_object_leaves_take_the_full_copy_every_time():
    @dataclasses.dataclass
    class Pos:
        rows: list

    slot = StagingPool(1).acquire()
    live = {"w": torch.ones(3), "pos": Pos([1, 2])}
    first = _stage(slot, live)
    staged = _stage(slot, live)
    assert staged is not first, "an object leaf is deep-copied by DCP's stager, never refilled"
    live["pos"].rows.append(3)
    assert staged["pos"].rows == [1, 2]
    assert _stage(slot, live)["pos"].rows == [1, 2, 3]


def test_shared_tensors_and_views_keep_their_values():
    slot = StagingPool(1).acquire()
    base = torch.arange(12.0)
    live = {"a": base[:6].view(2, 3), "b": base[6:], "a_again": base[:6].view(2, 3), "t": base[::2]}
    _stage(slot, live)
    base.mul_(-1)
    staged = _stage(slot, live)
    assert _same(staged, live)
    base.add_(1000)
    assert staged["b"][0].item() == -6.0 and staged["t"][1].item() == -2.0


def test_slots_keep_separate_copies():
    pool = StagingPool(2)
    a, b = pool.acquire(), pool.acquire()
    live = _state(1.0)
    sa = _stage(a, live)
    live["model"]["w2"].fill_(-1)
    sb = _stage(b, live)
    assert sa["model"]["w2"][0, 0].item() == 2.0 and sb["model"]["w2"][0, 0].item() == -1.0


def test_resolve_stateful_resolves_only_stateful_values():
    from tierckpt.staging.pool import resolve_stateful

    class App:
        def state_dict(self):
            return {"w": torch.ones(2)}

        def load_state_dict(self, sd):
            pass

    t = torch.zeros(3)
    out = resolve_stateful({"app": App(), "t": t, "d": {"x": 1}, "n": 4, "s": "a"})
    assert torch.equal(out["app"]["w"], torch.ones(2))
    assert out["t"] is t and out["d"] == {"x": 1} and out["n"] == 4 and out["s"] == "a"


def test_ordered_dicts_take_the_plan_and_keep_their_keys_and_order():
    # nn.Module.state_dict() and get_state_dict return OrderedDicts: same plan as plain dicts
    from collections import OrderedDict

    slot = StagingPool(1).acquire()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    live = {"model": model.state_dict(), "step": 1}
    assert type(live["model"]) is OrderedDict
    first = _stage(slot, live)
    assert _same(first, live)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = _stage(slot, {"model": model.state_dict(), "step": 2})
    assert second is first, "an OrderedDict state is refilled, not deep-copied again"
    assert list(second["model"]) == list(model.state_dict()) and second["step"] == 2
    assert _same(second["model"], model.state_dict())
    # a key renamed in the OrderedDict: a different structure, the full copy again
    renamed = OrderedDict((("x." + k), v) for k, v in model.state_dict().items())
    third = _stage(slot, {"model": renamed, "step": 3})
    assert third is not first and list(third["model"]) == list(renamed) and _same(third["model"], renamed)


class _Holder:
    """A TensorHolder: named tensors plus mutable metadata (as the Megatron payload's
    ShardedTensor/ShardedObject objects and common state)."""

    def __init__(self, tensors: dict, meta: dict, layout: str = "tp1"):
        self.tensors, self.meta, self.layout = tensors, meta, layout
        self.refreshed = 0

    def staging_key(self):
        if self.layout is None:
            return None
        return self.layout, tuple((k, v.shape, v.dtype) for k, v in self.tensors.items())

    def staging_tensors(self):
        return self.tensors

    def staging_refresh(self, live):
        self.meta = dict(live.meta)
        self.refreshed += 1


def test_tensor_holders_take_the_plan_and_refresh_their_metadata():
    from tierckpt.staging.copy_plan import TensorHolder

    slot = StagingPool(1).acquire()
    live = {"payload": _Holder({"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.bfloat16)},
                               {"iteration": 1}), "step": 1}
    assert isinstance(live["payload"], TensorHolder)
    first = _stage(slot, live)
    held = first["payload"]
    assert held is not live["payload"] and held.meta == {"iteration": 1}  # DCP's deep copy
    live["payload"].tensors["w"].mul_(-1)
    live["payload"].meta["iteration"] = 2
    live["step"] = 2
    assert held.meta == {"iteration": 1} and held.tensors["w"][1].item() == 1.0
    second = _stage(slot, live)
    assert second is first and second["payload"] is held, "same key: the staged holder is refilled"
    assert held.refreshed == 1 and held.meta == {"iteration": 2} and second["step"] == 2
    assert torch.equal(held.tensors["w"], -torch.arange(6.0)) and held.tensors["b"].dtype == torch.bfloat16
    assert held.tensors["w"].data_ptr() != live["payload"].tensors["w"].data_ptr()
    live["payload"].meta["iteration"] = 3  # the refresh copied it: later changes stay live-side
    assert held.meta == {"iteration": 2}


def test_a_changed_holder_key_or_a_holder_without_one_takes_the_full_copy():
    slot = StagingPool(1).acquire()
    live = {"payload": _Holder({"w": torch.zeros(4)}, {})}
    first = _stage(slot, live)
    live["payload"].layout = "tp2"  # e.g. a parallel layout change: different write metadata
    second = _stage(slot, live)
    assert second is not first and second["payload"].layout == "tp2"
    live["payload"].layout = None  # no key: never refilled
    third = _stage(slot, live)
    assert _stage(slot, live) is not third
