"""A tier due while its previous save still runs (``TierConfig.busy_tier_policy``), 2 gloo ranks
as 2 nodes (tests/scenarios_defer.py):

- "defer" (default): the save returns without waiting for the slow one (blocking far below the
  injected delay), is recorded as deferred with the running step on both ranks, and ``due()``
  brings the tier back at the first step at which the slow save finished on every rank; that
  step restores bitwise; persistent and local tier alike;
- "wait": the old behaviour, the save blocks until the slow one finished, both commit;
- planned exits never defer: ``save(..., wait_previous=True)`` and ``save_for_preemption``
  wait and commit the final step;
- a bad option value is a ConfigError naming the option and the allowed values.
"""

from __future__ import annotations

import os

import pytest

from tests import scenarios_defer as sd
from tests.harness import run_world
from tests.scenarios import make_config
from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.history.ledger import Ledger, summarize
from tierckpt.io.storage import Store

DELAY = 3.0  # seconds the slow save sleeps


def _values(results):
    for r in results:
        assert r.error is None, r.error
    return [r.value for r in results]


def _check_deferred_then_due(out, tier, interval):
    r0, r1 = out
    for r in out:
        assert r["deferred"] == {"step": 2 * interval, "running_step": interval, "deferred": True, "skipped": True,
                                 "ok": False}
        assert r["started"] == []
        assert r["deferred_blocking_s"] < DELAY / 4
        assert r["restored"] == r["retry_step"]
    assert r0["retry_step"] == r1["retry_step"] and r0["due_steps"] == r1["due_steps"]
    x = r0["retry_step"]
    # due at interval, at 2*interval (deferred), then not again until x
    assert r0["due_steps"] == [interval, 2 * interval, x]
    assert x > 2 * interval
    before, after = r0["busy_before"], r0["busy_after"]
    # at x the slow save had finished on every rank (the agreed poll said so) ...
    assert not any(b[x] for b in after)
    # ... and x is the first step at which it had (no step where every rank saw it done was skipped)
    first_done = min(s for s in before[0] if s > 2 * interval and not any(b[s] for b in before))
    assert x <= first_done
    for r in out:  # the same agreed records on both ranks, in order
        assert sorted(h for h in r["history"] if h[1] in (2 * interval, x)) == [
            (tier, 2 * interval, False, True), (tier, x, True, False)]


def _ledger_checkpoints(base):
    recs = Ledger.read_records(Store(os.path.join(base, "pfs")))
    return [r for r in recs if getattr(r, "kind", None) == "checkpoint"], recs


def test_persistent_deferred_then_due_when_finished(tmp_path):
    base = str(tmp_path)
    out = _values(run_world(sd.phase_defer_with_due, 2, base, "persistent", DELAY, 2, 400))
    _check_deferred_then_due(out, "persistent", 2)
    ckpts, recs = _ledger_checkpoints(base)
    deferred = [r for r in ckpts if r.deferred]
    assert [(r.tier, r.step, r.running_step, r.skipped, r.ok) for r in deferred] == [("persistent", 4, 2, True, False)]
    assert sorted(r.step for r in ckpts if r.ok) == [2, out[0]["retry_step"]]
    summary = summarize(recs)["checkpoints"]["persistent"]
    assert (summary["ok"], summary["failed"], summary["deferred"]) == (2, 0, 1)


def test_local_deferred_then_due_when_finished(tmp_path):
    base = str(tmp_path)
    out = _values(run_world(sd.phase_defer_with_due, 2, base, "local", DELAY, 2, 400))
    _check_deferred_then_due(out, "local", 2)
    ckpts, _ = _ledger_checkpoints(base)
    assert [(r.step, r.running_step) for r in ckpts if r.deferred] == [(4, 2)]


def test_policy_wait_blocks_and_commits_both(tmp_path):
    out = _values(run_world(sd.phase_policy, 2, str(tmp_path), "wait", DELAY, False))
    for r in out:
        assert r["blocking_s"] > DELAY / 2  # waited for the slow step-2 write
        assert r["started"] == ["persistent"] and r["deferred"] == {}
        assert r["outcome"] == {"persistent": True}
        assert r["committed"] == [2, 4]
        assert r["copies"] == 1


def test_policy_defer_without_intervals(tmp_path):
    out = _values(run_world(sd.phase_policy, 2, str(tmp_path), "defer", DELAY, False))
    for r in out:
        assert r["blocking_s"] < DELAY / 4
        assert r["started"] == [] and r["deferred"] == {"persistent": (True, 2)}
        assert r["committed"] == [2]
        assert r["copies"] == 0  # its job still ran here: sure to be deferred, nothing copied


def test_wait_previous_never_defers(tmp_path):
    out = _values(run_world(sd.phase_policy, 2, str(tmp_path), "defer", DELAY, True))
    for r in out:
        assert r["blocking_s"] > DELAY / 2
        assert r["started"] == ["persistent"] and r["deferred"] == {}
        assert r["committed"] == [2, 4]


def test_preemption_saves_a_deferred_tier(tmp_path):
    out = _values(run_world(sd.phase_preemption_after_defer, 2, str(tmp_path), DELAY))
    for r in out:
        assert r["deferred_first"] is True
        assert r["preempted_committed"] == {"persistent": True}
        assert r["committed"] == [2, 3]


@pytest.mark.parametrize("value, option, needle", [
    ("later", "busy_tier_policy", "'defer' or 'wait'"),
    ({"persistent": "block"}, "busy_tier_policy.persistent", "'defer' or 'wait'"),
    ({"remote": "wait"}, "busy_tier_policy", "allowed: local, persistent"),
    (None, "busy_tier_policy", "'defer' or 'wait'"),
])
def test_bad_busy_tier_policy(tmp_path, value, option, needle):
    with pytest.raises(ConfigError) as e:
        make_config(str(tmp_path), busy_tier_policy=value)
    assert e.value.option == option and needle in str(e.value)


def test_busy_tier_policy_values(tmp_path):
    base = str(tmp_path)
    assert TierConfig(local_root=base + "/{node}", persistent_root=base).busy_tier_policy == {
        "local": "defer", "persistent": "defer"}
    assert make_config(base, busy_tier_policy={"persistent": "wait"}).busy_tier_policy == {
        "local": "defer", "persistent": "wait"}
