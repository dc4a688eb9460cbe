"""Adaptive intervals inside the engine: agreed across ranks, driven by measured δ and the
ledger's failure evidence, visible in the ledger."""

from __future__ import annotations

import os

from tests import scenarios
from tests.harness import run_world
from tierckpt.history.ledger import Ledger
from tierckpt.io.storage import Store


def test_adaptive_intervals_agree_and_shorten_after_failures(tmp_path):
    base = str(tmp_path)
    first = run_world(scenarios.phase_adaptive, 2, base, False, 14)  # ends without run_end: a failure
    for r in first:
        assert r.value["agreed"], r.value
    assert first[0].value["saved"] == first[1].value["saved"]
    # every rank gets the decisions for its metric writers (Megatron's live on the last rank)
    assert first[0].value["decisions"] and first[0].value["decisions"] == first[1].value["decisions"]
    recs = Ledger.read(Store(os.path.join(base, "pfs")))
    sched = [r for r in recs if r["kind"] == "schedule"]
    assert {r["trigger"] for r in sched} >= {"start", "checkpoint"}
    assert all(k in sched[-1] for k in ("delta", "M", "R", "p", "tau_s", "tau_steps", "reason"))
    m_before = [r["M"] for r in sched if r["trigger"] == "start"][0]
    # two more crashed runs: the MTBF estimate must drop and the intervals shorten
    for _ in range(2):
        run_world(scenarios.phase_adaptive, 2, base, False, 4)
    after = run_world(scenarios.phase_adaptive, 2, base, True, 4)
    recs = Ledger.read(Store(os.path.join(base, "pfs")))
    starts = [r for r in recs if r["kind"] == "schedule" and r["trigger"] == "start"]
    assert starts[-1]["M"] < m_before, (m_before, starts[-1]["M"])
    assert after[0].value["agreed"]
