"""megatron-core wheel: the shipped config's TP2 × PP2 layout on 4 CPU ranks, and a DP change.

- ``test_tp2pp2_tiers_and_export`` (``scenarios_pp.phase_tp2pp2``): a tiny GPT trained through
  Megatron's pipeline schedule on gloo; iteration 3 restored bitwise from own-local, from a peer
  replica (the last stage's node lost) and from persistent; the export of a TP2 × PP2
  dp_reshardable checkpoint equals the persistent step and loads back bitwise.
"""

from __future__ import annotations

import pytest

from tests.harness import run_world

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

ENV2 = {"OMP_NUM_THREADS": "1", "TIERCKPT_RANKS_PER_NODE": "2"}


def test_tp2pp2_tiers_and_export(tmp_path):
    from tests.mcore import scenarios_pp

    res = run_world(scenarios_pp.phase_tp2pp2, 4, str(tmp_path), timeout=300, env=ENV2)
    vals = [r.value for r in res]
    assert all(v["train"] == vals[0]["train"] and v["ref4"] == vals[0]["ref4"] for v in vals), vals
    assert vals[0]["exported_tensors"] > 0
