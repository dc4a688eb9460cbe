"""A restore template that does not fit the saved step is refused fast, in one line (issue 29 D).

Saving fp32 and restoring into a bf16 template (or another global shape, or a key the
checkpoint lacks) must raise :class:`tierckpt.TemplateMismatchError` on every rank, whose first
line names the key, the saved and the template value, before any attempt: no source is read,
no replica pulled, no file or directory of any node's local root or of the persistent root
changes (inodes, mtimes, sizes; the ledger included). A model-only template (keys the
checkpoint has and the template lacks) still restores, bitwise.
"""

from __future__ import annotations

import shutil

import torch

import pytest

from tests import scenarios_template as st
from tests.harness import run_world

FIRST = {
    "dtype": "model.0.weight: checkpoint dtype torch.float32 != template torch.bfloat16",
    "shape": "model.0.weight: checkpoint shape (8, 4) != template (10, 4)",
    "missing": "model.1.weight: checkpoint has no such key != template tensor torch.float32 (3, 3)",
    "plain_shape": "model.0.bias: checkpoint shape (8,) != template (9,)",
    "persistent": "model.0.weight: checkpoint dtype torch.float32 != template torch.bfloat16",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("template"))
    run_world(st.phase_save, 2, base)
    return base


def _check_refused(out: dict, first: str) -> None:
    assert out["type"] == "TemplateMismatchError", out["message"][:2000]
    assert "TierckptError" in out["bases"]
    lines = out["message"].splitlines()
    assert lines[0] == first, lines
    assert len(lines) <= 3, lines
    assert "Traceback" not in out["message"] and "CheckpointException" not in out["message"]
    assert out["calls"] == {"attempt": 0, "cluster": 0, "pull": 0}, out["calls"]
    assert out["changed"] == [], out["changed"]


def test_mismatching_templates_are_refused_before_any_source(saved, tmp_path):
    base = str(tmp_path / "run")
    shutil.copytree(saved, base)
    res = run_world(st.phase_refuse, 2, base)
    for case, first in FIRST.items():
        for r in res:  # every rank, the same first line
            _check_refused(r.value[case], first)
    # the persistent-only refusal names the persistent step, the others a node's own copy
    assert "persistent step" in res[0].value["persistent"]["message"].splitlines()[1]
    assert "own copy" in res[0].value["dtype"]["message"].splitlines()[1]
    for r in res:
        mo = r.value["model_only"]
        assert mo["step"] == st.STEP and mo["attempts"] == 1 and mo["equal"], mo
        assert mo["sources"] == ["own-local"], mo


def test_refused_when_the_source_is_a_replica(saved, tmp_path):
    base = str(tmp_path / "run")
    shutil.copytree(saved, base)
    res = run_world(st.phase_refuse_replica, 2, base)
    assert res[0].value["node0_sources"] == [1]  # node 0's state: only node 1's replica is left
    for r in res:
        _check_refused(r.value, FIRST["dtype"])
    assert "replica on node 1" in res[0].value["message"].splitlines()[1]


def test_resharded_in_cluster_restore_is_checked_against_the_merged_view(saved, tmp_path):
    base = str(tmp_path / "run")
    shutil.copytree(saved, base)
    out = run_world(st.phase_refuse_cluster, 1, base)[0].value
    _check_refused(out, FIRST["dtype"])
    assert "in-cluster" in out["message"].splitlines()[1]
    # the same step with a fitting template: resharded from the node-local copies, one attempt
    assert out["ok"] == {"sources": ["in-cluster"], "attempts": 1, "equal": True}, out["ok"]


# ----------------------------------------------------------------------------- units
def _md(**items):
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       TensorProperties, TensorStorageMetadata)
    sd = {}
    for k, v in items.items():
        if v is None:
            sd[k] = BytesStorageMetadata()
        else:
            dtype, size = v
            sd[k] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                          [ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))])
    return Metadata(state_dict_metadata=sd)


def test_mismatches_kinds_partial_loads_and_exempt_shapes():
    from tierckpt.io.planner import VerifyingLoadPlanner
    from tierckpt.restore.template import mismatches, planner_view

    md = _md(**{"m.w": (torch.float32, (4, 2)), "m.b": (torch.float32, (4,)), "o.lr": None, "o.step": None,
                "unused": (torch.int64, (1,))})
    planner = VerifyingLoadPlanner()
    ok = {"m": {"w": torch.zeros(4, 2), "b": torch.zeros(4)}, "o": {"lr": 0.1}}
    assert mismatches(planner_view(ok, planner), md, planner) == []  # "unused", "o.step": only saved
    bad = {"m": {"w": torch.zeros(4, 2, dtype=torch.float16), "b": 3.0}, "o": {"lr": torch.tensor(0.1)},
           "new": torch.zeros(2)}
    assert mismatches(planner_view(bad, planner), md, planner) == [
        "m.w: checkpoint dtype torch.float32 != template torch.float16",
        "m.b: checkpoint tensor torch.float32 (4,) != template object float",
        "new: checkpoint has no such key != template tensor torch.float32 (2,)",
        "o.lr: checkpoint object != template tensor torch.float32 ()",
    ]
    partial = VerifyingLoadPlanner(allow_partial_load=True)
    assert mismatches(planner_view({"new": torch.zeros(2)}, partial), md, partial) == []
    assert mismatches(planner_view({"new": torch.zeros(2)}, planner), md, planner, all_keys=False) == []

    class Exempt(VerifyingLoadPlanner):
        def shape_may_differ(self, fqn):
            return fqn == "m.w"

    wide = {"m": {"w": torch.zeros(5, 2), "b": torch.zeros(5)}}
    assert mismatches(planner_view(wide, Exempt()), md, Exempt()) == ["m.b: checkpoint shape (4,) != template (5,)"]


def test_planner_view_resolves_stateful_values_without_touching_the_state():
    from tierckpt.io.planner import VerifyingLoadPlanner
    from tierckpt.restore.template import planner_view

    class S:
        calls = 0

        def state_dict(self):
            S.calls += 1
            return {"x": torch.zeros(2, device="meta")}

        def load_state_dict(self, sd):
            raise AssertionError("not loaded")

    sd = {"s": S(), "y": {"z": 1}}
    view = planner_view(sd, VerifyingLoadPlanner())
    assert sorted(view) == ["s.x", "y.z"] and view["s.x"].is_meta and S.calls == 1
    assert isinstance(sd["s"], S) and sd["y"] == {"z": 1}


def test_error_message_is_short_and_names_the_first_mismatch():
    from tierckpt import TemplateMismatchError, TierckptError

    many = [f"k{i}: checkpoint dtype torch.float32 != template torch.bfloat16" for i in range(8)]
    err = TemplateMismatchError(7, [(0, many, 300), (1, many[:2], 2)], ranks=64, where="node 0's own copy")
    lines = str(err).splitlines()
    assert isinstance(err, TierckptError) and err.step == 7 and err.ranks == 64
    assert lines[0] == many[0]
    assert "300 mismatch(es) on rank 0, and mismatches on 63 other rank(s)" in lines[1]
    assert len(lines) == 3 and lines[2].startswith("also: k1: ") and len(lines[2]) < 420
