"""Retention rules (tierckpt/tiers/keep.py), their record (tierckpt-retention.json) and their
TierConfig options: pure logic and one directory of hand-made committed steps, no processes."""

from __future__ import annotations

import json

import pytest

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.history.timeline import save_key
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.tiers import keep
from tierckpt.tiers.retention import InUse, purge_persistent, read_record


def _copies(steps, run="a", gen=0, t0=None, dt=None, first_seq=0):
    """One save per step, in order (one timeline); committed_s t0 + i*dt when given."""
    return [keep.Copy(s, f"{run}.{first_seq + i}", save_key(s, f"{run}.{first_seq + i}", (gen, first_seq + i)),
                      None if t0 is None else t0 + i * dt) for i, s in enumerate(steps)]


def test_newest_k_by_save_order_and_zero_keeps_all():
    old = _copies([10, 20, 30], run="a", gen=0)
    new = _copies([11, 12], run="b", gen=1)  # a later run resumed from 10: newer than a's 20 and 30
    assert keep.decide(old + new, keep.Policy(latest_k=2)) == {11: ("newest 2",), 12: ("newest 2",)}
    assert set(keep.decide(old, keep.Policy(latest_k=0))) == {10, 20, 30}
    assert keep.decide(old, keep.Policy(latest_k=0))[20] == (keep.KEEP_ALL,)


def test_every_n_steps_keeps_the_first_save_of_each_window_but_the_first():
    got = keep.decide(_copies(range(5, 131, 5)), keep.Policy(latest_k=1, every_n_steps=50))
    assert got == {50: ("every 50 steps",), 100: ("every 50 steps",), 130: ("newest 1",)}
    # a window whose multiple was not saved keeps the first step saved after it
    got = keep.decide(_copies([30, 70, 90, 140]), keep.Policy(latest_k=1, every_n_steps=50))
    assert got == {70: ("every 50 steps",), 140: ("newest 1", "every 50 steps")}


def test_interval_keeps_the_first_commit_of_each_window_and_skips_untimed_copies():
    cs = _copies([10, 20, 30, 40, 50], t0=7150.0, dt=40.0)  # 7150, 7190, 7230, 7270, 7310
    cs.append(keep.Copy(60, "a.9", save_key(60, "a.9", (0, 9)), None))  # no committed_s: no part
    got = keep.decide(cs, keep.Policy(latest_k=1, interval_s=100.0))
    # windows of 100 s: [7100, 7200) first 10; [7200, 7300) first 30; [7300, 7400) first 50
    assert got == {10: ("one per 100 s",), 30: ("one per 100 s",), 50: ("one per 100 s",), 60: ("newest 1",)}


def test_period_milestones_and_protection():
    got = keep.decide(_copies([90, 100, 110, 120, 200, 210]),
                      keep.Policy(latest_k=1, period=100, steps=frozenset({110, 999})), protect={90: keep.RESTORED,
                                                                                                5: keep.ANCHOR})
    assert got == {90: (keep.RESTORED,), 100: ("period 100",), 110: (keep.MILESTONE,), 200: ("period 100",),
                   210: ("newest 1",)}  # 999 and 5 are not among the copies: nothing to keep


def test_picks_carry_over_for_the_same_save_only_and_transient_reasons_do_not():
    cs = _copies([40, 50, 60, 70])
    picked = {40: ("a.0", ("every 40 steps", "newest 2")), 50: ("other.3", ("milestone",)),
              60: ("a.2", ("restored from", "newest 2"))}
    got = keep.decide(cs, keep.Policy(latest_k=1), picked=picked)
    assert got == {40: ("every 40 steps",), 70: ("newest 1",)}  # 50 is another save now; 60's reasons lapse
    assert keep.sticky("one per 3600 s") and keep.sticky("period 7") and not keep.sticky("newest 3")
    assert not keep.sticky(keep.RESTORED) and not keep.sticky(keep.ANCHOR) and not keep.sticky(keep.KEEP_ALL)


def test_policy_of_a_config_local_tier_keeps_newest_k_only(tmp_path):
    cfg = TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"),
                     keep_latest_k={"local": 3, "persistent": 2}, keep_interval_s=3600, keep_every_n_steps=50,
                     keep_period=1000, keep_steps=[120, 7, 120])
    assert keep.Policy.of(cfg, "persistent") == keep.Policy(2, 3600.0, 50, 1000, frozenset({7, 120}))
    assert keep.Policy.of(cfg, "local") == keep.Policy(latest_k=3)
    assert cfg.keep_steps == (7, 120)


@pytest.mark.parametrize("field,value,option,words", [
    ("keep_interval_s", 0, "keep_interval_s", "> 0"),
    ("keep_interval_s", float("nan"), "keep_interval_s", "keep_interval_s"),
    ("keep_every_n_steps", 0, "keep_every_n_steps", ">= 1"),
    ("keep_every_n_steps", True, "keep_every_n_steps", "integer"),
    ("keep_period", 2.5, "keep_period", "integer"),
    ("keep_steps", [120, -1], "keep_steps[1]", ">= 0"),
    ("keep_steps", "120", "keep_steps", "list of steps"),
    ("keep_stepz", [1], "keep_stepz", "keep_steps"),
])
def test_bad_retention_options_name_the_field(tmp_path, field, value, option, words):
    with pytest.raises(ConfigError) as e:
        TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"), **{field: value})
    assert e.value.option == option and words in str(e.value), str(e.value)


# -- the persistent root's retention with its record ---------------------------------------------
def _commit(store: Store, step: int, seq: int, t: float, run: str = "a", gen: int = 0) -> None:
    rel = layout.persistent_step(step)
    store.makedirs(rel)
    with store.open(f"{rel}/__0_0.distcp", "wb") as f:
        f.write(b"x%d" % step)
    e = manifest.hash_file(store, f"{rel}/__0_0.distcp")
    manifest.commit(store, rel, [manifest.FileEntry("__0_0.distcp", e.size, e.xxh3_64)], tier="persistent",
                    step=step, save_id=f"{run}.{seq}", save_order=[gen, seq], committed_s=t)


def _steps(store: Store) -> list[int]:
    return sorted(s for s in (layout.parse_step(n) for n in store.listdir("")) if s is not None
                  and manifest.read_committed(store, layout.persistent_step(s)) is not None)


def test_record_keeps_earlier_picks_across_an_option_change(tmp_path):
    """A restart with another window size (or none) keeps the picks recorded before it; the
    record names every kept step's reasons and is written before anything is deleted."""
    store = Store(str(tmp_path))
    every50 = keep.Policy(latest_k=2, every_n_steps=50)
    for i, s in enumerate(range(10, 130, 10)):
        _commit(store, s, i, 1000.0 + i)
        purge_persistent(store, 2, InUse(), policy=every50, record=True)
    assert _steps(store) == [50, 100, 110, 120]
    rec = json.loads(store.read_bytes(layout.RETENTION))
    assert rec["kept"]["step-50"] == {"step": 50, "save_id": "a.4", "reasons": ["every 50 steps"]}
    assert rec["policy"]["keep_every_n_steps"] == 50 and rec["policy"]["keep_latest_k"] == 2
    # restart with keep_every_n_steps = 40: 50 and 100 stay (recorded picks), 120 is [120, 160)'s pick
    every40 = keep.Policy(latest_k=2, every_n_steps=40)
    _commit(store, 130, 12, 2000.0, run="b", gen=1)
    purge_persistent(store, 2, InUse(), policy=every40, record=True)
    assert _steps(store) == [50, 100, 120, 130]
    # 50 is also the first step left in [40, 80): the new rule's reason joins the recorded one
    assert read_record(store)[""][50] == ("a.4", ("every 40 steps", "every 50 steps"))
    # restart without the window rule: no rule would pick 50, 100 or 120 now; the record keeps them
    for i, s in enumerate((140, 150, 160), start=13):
        _commit(store, s, i, 3000.0 + i, run="c", gen=2)
        purge_persistent(store, 2, InUse(), policy=keep.Policy(latest_k=2), record=True)
    assert _steps(store) == [50, 100, 120, 150, 160]
    assert read_record(store)[""][120] == ("a.11", ("every 40 steps",))


def test_a_damaged_record_keeps_every_committed_step_for_one_pass(tmp_path, caplog):
    store = Store(str(tmp_path))
    for i, s in enumerate((10, 20, 30, 40)):
        _commit(store, s, i, 1000.0 + i)
    store.write_atomic(layout.RETENTION, b"{not json")
    assert read_record(store) is None
    assert purge_persistent(store, 1, InUse(), policy=keep.Policy(latest_k=1), record=True) == []
    assert "cannot be read" in caplog.text and _steps(store) == [10, 20, 30, 40]
    assert purge_persistent(store, 1, InUse(), policy=keep.Policy(latest_k=1), record=True) == [10, 20, 30]


def test_local_root_records_newest_k_and_anchor_and_ls_reads_them(tmp_path):
    """The local tier keeps its newest k and the local anchor; the node root's record names them
    for its own steps and the replicas it holds, and ``tierckpt ls`` (tierckpt/cli/kept.py) reads it."""
    from tierckpt.cli.kept import kept_because, label
    from tierckpt.cli.steps import find_steps
    from tierckpt.tiers.retention import purge_local

    root = tmp_path / "node-0"
    store = Store(str(root))
    for parent in ("local", "replicas/node-1"):
        for i, s in enumerate((10, 20, 30)):
            rel = f"{parent}/step-{s}"
            store.makedirs(rel)
            with store.open(f"{rel}/__0_0.distcp", "wb") as f:
                f.write(b"x")
            e = manifest.hash_file(store, f"{rel}/__0_0.distcp")
            manifest.commit(store, rel, [manifest.FileEntry("__0_0.distcp", e.size, e.xxh3_64)], tier="local",
                            step=s, save_id=f"a.{i}", save_order=[0, i])
    assert purge_local(store, 1, InUse(), protect={20}, record=True) == {"local": [10], "node-1": [10]}
    rec = read_record(store)
    assert rec["local"] == {20: ("a.1", (keep.ANCHOR,)), 30: ("a.2", ("newest 1",))}
    assert rec["replicas/node-1"] == rec["local"]
    steps = find_steps(str(tmp_path))
    why = kept_because(steps)
    assert {(s.tier, s.step): label(why[id(s)], s.committed) for s in steps} == {
        ("local", 20): keep.ANCHOR, ("local", 30): "newest 1", ("replica", 20): keep.ANCHOR,
        ("replica", 30): "newest 1"}
