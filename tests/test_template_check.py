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
