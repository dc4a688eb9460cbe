"""megatron-core wheel: the shipped config's TP2 × PP2 layout on 4 CPU ranks, and a DP change.

- ``test_tp2pp2_tiers_and_export`` (``scenarios_pp.phase_tp2pp2``): a tiny GPT trained through
  Megatron's pipeline schedule on gloo; iteration 3 restored bitwise from own-local, from a peer
  replica (the last stage's node lost) and from persistent; the export of a TP2 × PP2
  dp_reshardable checkpoint equals the persistent step and loads back bitwise.
- ``test_dp_change_reshards_in_cluster_and_a_model_parallel_change_loads_persistent``: DP4 →
  DP2 reshards the dp_reshardable local tier from the in-cluster copies, bitwise, no persistent
  byte; a changed bucket layout or TP size skips them for the persistent step (ledger record);
  without a persistent step the error names it.
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


def test_dp_change_reshards_in_cluster_and_a_model_parallel_change_loads_persistent(tmp_path):
    """4 ranks (2 nodes of 2, TP1 × DP4) save; 2 ranks (2 nodes of 1) restore
    (``scenarios_pp.phase_dp4_save``, ``phase_dp2_restore``)."""
    from tests.mcore import scenarios_pp

    run_world(scenarios_pp.phase_dp4_save, 4, str(tmp_path), timeout=300, env=ENV2)
    res = run_world(scenarios_pp.phase_dp2_restore, 2, str(tmp_path), timeout=300,
                    env={"OMP_NUM_THREADS": "1", "TIERCKPT_RANKS_PER_NODE": "1"})
    v = res[0].value
    assert res[1].value == v
    dp = v["dp"]  # DP4 -> DP2: no conversion, no persistent byte
    assert dp == {"reason": None, "sources": {0: "in-cluster", 1: "in-cluster"}, "step": 3,
                  "format": "dp_reshardable", "persistent_bytes": 0}, dp
    b = v["buckets"]
    assert b["sources"] == {0: "persistent", 1: "persistent"} and b["step"] == 3, b
    assert b["format"] == "fully_reshardable" and b["persistent_bytes"] > 0, b
    assert b["reason"].startswith("local tier is dp_reshardable: saved DP=4, now DP=2, and bucket "
                                  "optimizer.distributed.dp_group_idx_0."), b["reason"]
    assert b["reason"].endswith("; loading the fully_reshardable persistent step 3"), b["reason"]
    tp = v["tp"]
    assert tp["reason"] == ("local tier is dp_reshardable: saved TP=1, now TP=2, saved DP=4, now DP=1; "
                            "loading the fully_reshardable persistent step 3"), tp
    assert tp["sources"] == {0: "persistent", 1: "persistent"} and tp["format"] == "fully_reshardable", tp
    assert [p["reason"] for p in v["policy"]] == [b["reason"], tp["reason"]], v["policy"]
    pol = v["policy"][1]
    assert pol["sources"] == ["persistent"] and pol["local_step"] == 3 and pol["persistent_step"] == 3, pol
    assert (pol["saved_layout"]["tp"], pol["layout"]["tp"]) == (1, 2), pol
    err = v["error"]
    assert err and err.startswith("local tier is dp_reshardable: saved TP=1, now TP=2, saved DP=4, now DP=1, so "
                                  "the node-local and replica copies cannot be loaded"), err
    assert "the persistent tier" in err and "--save" in err and "committed persistent steps: []" in err, err


def test_layout_change_names_every_changed_size():
    """The reasons' text; a DP-only change is left to the bucket check."""
    from mcore_plugin.layout import bucket_change, dp_changed, layout_change

    key = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_{}.param"
    base = {"world_size": 8, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "dp": 2, "buckets": {key.format(0, 0): (640,)}}
    fewer = {**base, "world_size": 4, "dp": 1}
    assert layout_change(base, dict(base), "dp_reshardable") is None and not dp_changed(base, dict(base))
    assert layout_change(None, base, "dp_reshardable") is None  # a step from before layouts were recorded
    assert layout_change(base, None, "dp_reshardable") is None  # Megatron's parallel state not initialised
    assert layout_change(base, fewer, "dp_reshardable") is None and dp_changed(base, fewer)
    assert layout_change(base, {**base, "tp": 1, "dp": 4}, "fully_reshardable") == \
        "local tier is fully_reshardable: saved TP=2, now TP=1, saved DP=2, now DP=4"
    assert bucket_change(base, {key.format(0, 0): (640,)}, "dp_reshardable", fewer) is None
    assert bucket_change(base, {key.format(1, 0): (512,)}, "dp_reshardable", fewer) is None  # another group
    assert bucket_change(base, {key.format(0, 0): (512,)}, "dp_reshardable", fewer) == (
        f"local tier is dp_reshardable: saved DP=2, now DP=1, and bucket {key.format(0, 0)} changed "
        "(saved global shape (640,), now (512,))")
    assert bucket_change(base, {key.format(0, 0): (640,), key.format(0, 1): (64,)}, "dp_reshardable", fewer) == (
        f"local tier is dp_reshardable: saved DP=2, now DP=1, and bucket {key.format(0, 1)} changed "
        "(saved global shape None, now (64,))")
    assert bucket_change({**base, "buckets": None}, {}, "dp_reshardable", fewer) == \
        "local tier is dp_reshardable: saved DP=2, now DP=1, and the step does not record its optimizer buckets"
