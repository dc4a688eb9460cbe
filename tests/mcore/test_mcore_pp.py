"""megatron-core wheel: the shipped config's TP2 × PP2 layout on 4 CPU ranks, and a DP change.

- ``test_tp2pp2_tiers_and_export`` (``scenarios_pp.phase_tp2pp2``): a tiny GPT trained through
  Megatron's pipeline schedule on gloo; iteration 3 restored bitwise from own-local, from a peer
  replica (the last stage's node lost) and from persistent; the export of a TP2 × PP2
  dp_reshardable checkpoint equals the persistent step and loads back bitwise.
- ``test_dp_change_loads_the_persistent_step``: DP4 → DP2 skips the node-local copies for the
  persistent step (bitwise, ledger record); without a persistent step the error names it.
- ``test_layout_change_names_every_changed_size``: the reason's text.
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


def test_dp_change_loads_the_persistent_step(tmp_path):
    """DP4 → DP2 (``scenarios_pp.phase_dp4_save`` on 4 ranks, ``phase_dp2_restore`` on 2):
    the dp_reshardable node-local copies are skipped for the persistent step, bitwise; without
    a persistent step the error names the persistent tier."""
    from tests.mcore import scenarios_pp

    env = {"OMP_NUM_THREADS": "1", "TIERCKPT_RANKS_PER_NODE": "1"}
    run_world(scenarios_pp.phase_dp4_save, 4, str(tmp_path), timeout=300, env=env)
    res = run_world(scenarios_pp.phase_dp2_restore, 2, str(tmp_path), timeout=300, env=env)
    v = res[0].value
    assert res[1].value["reason"] == v["reason"] and res[1].value["error"] == v["error"]
    assert v["reason"] == ("local tier is dp_reshardable: saved DP=4, now DP=2; loading the fully_reshardable "
                           "persistent step 3"), v["reason"]
    assert v["step"] == 3 and v["sources"] == {0: "persistent", 1: "persistent"}, v
    assert v["format"] == "fully_reshardable" and v["persistent_bytes"] > 0, v
    assert len(v["policy"]) == 1, v["policy"]
    pol = v["policy"][0]
    assert pol["sources"] == ["persistent"] and pol["local_step"] == 3 and pol["persistent_step"] == 3, pol
    assert (pol["saved_layout"]["dp"], pol["layout"]["dp"]) == (4, 2), pol
    err = v["error"]
    assert err and "saved DP=4, now DP=2" in err and "the persistent tier" in err and "--save" in err, err
    assert "committed persistent steps: []" in err, err


def test_layout_change_names_every_changed_size():
    from mcore_plugin.layout import layout_change

    base = {"world_size": 8, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "dp": 2}
    assert layout_change(base, dict(base), "dp_reshardable") is None
    assert layout_change(None, base, "dp_reshardable") is None  # a step from before layouts were recorded
    assert layout_change(base, None, "dp_reshardable") is None  # Megatron's parallel state not initialised
    assert layout_change(base, {**base, "world_size": 4, "dp": 1}, "dp_reshardable") == \
        "local tier is dp_reshardable: saved DP=2, now DP=1"
    assert layout_change(base, {**base, "tp": 1, "dp": 4}, "fully_reshardable") == \
        "local tier is fully_reshardable: saved TP=2, now TP=1, saved DP=2, now DP=4"
