"""Typed ledger records (tierckpt.records): round trip per kind, the exact keys each kind
writes (golden lines: the on-disk format must not drift), and the tolerant reader."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from tierckpt.history.journal import RunJournal
from tierckpt.history.ledger import Ledger
from tierckpt.io.layout import LEDGER
from tierckpt.io.storage import Store
from tierckpt.records import (
    CHECKPOINT_SCHEMA,
    KINDS,
    RECOVERY_PHASES,
    CheckpointRecord,
    GenericRecord,
    PreemptionRecord,
    RecoveryRecord,
    RedundancyRecord,
    RestoreRecord,
    RollbackRecord,
    RunEndRecord,
    RunStartRecord,
    ScheduleRecord,
    parse_records,
    record_from_ledger,
)
from tierckpt.restore import NodeOutcome, RestoreResult, Source
from tierckpt.sched.schedule import Decision

ENV = ["kind", "time", "run_id", "job"]

DECISION = Decision(tier="local", delta=0.2, M=3600.0, R=30.0, p=0.1, tau_s=120.0, tau_steps=40, reason="daly",
                    M_eff=3600.0, C=5.0, step_s=3.0, tau_model_s=118.0,
                    sources={"delta": "observed", "M": "ledger", "R": "prior", "p": "prior"}, delta_blocking=0.15)

# one record per kind as the engine (and the titan adapter, for a seed) writes it, with the
# keys written before typed records existed, in order
GOLDEN = [
    (RunStartRecord(world_size=8, nodes=2, ranks_per_node=4, restart_count=1, host="h0", tiers=["local", "persistent"],
                    process_start=1.7e9, replication_jump=1, replication_factor=2, lineage="abc"),
     ["world_size", "nodes", "ranks_per_node", "restart_count", "host", "tiers", "process_start",
      "replication_jump", "replication_factor", "lineage"]),
    (RunEndRecord(clean=True, exposure_s=60.0, reason="", durable_step=20),
     ["clean", "exposure_s", "reason", "durable_step"]),
    (RunEndRecord(clean=False, exposure_s=60.0, reason="x", durable_step=None, stuck_tiers=["local"],
                  failures=[{"tier": "persistent", "step": 3, "error": "boom"}]),
     ["clean", "exposure_s", "reason", "durable_step", "stuck_tiers", "failures"]),
    (CheckpointRecord(tier="local", step=10, ok=True, blocking_s=0.5, wait_s=0.0, bytes=100, background_s=2.0,
                      interference_s=0.1),
     ["tier", "step", "ok", "error", "blocking_s", "wait_s", "bytes", "background_s", "interference_s", "schema"]),
    (CheckpointRecord(tier="local", step=12, ok=False, error="stuck", blocking_s=5.0, wait_s=5.0, skipped=True,
                      stuck_nodes=[1], replicas_failed={"2": "timeout"}),
     ["tier", "step", "ok", "error", "blocking_s", "wait_s", "bytes", "background_s", "skipped", "stuck_nodes",
      "replicas_failed", "interference_s", "schema"]),
    (CheckpointRecord(tier="persistent", step=14, ok=False, error="busy", blocking_s=0.001, wait_s=0.001,
                      skipped=True, deferred=True, running_step=12),
     ["tier", "step", "ok", "error", "blocking_s", "wait_s", "bytes", "background_s", "skipped", "interference_s",
      "deferred", "running_step", "schema"]),
    (RestoreRecord(step=10, seconds=4.2, attempts=1, persistent_bytes=0, bytes=6 << 30,
                   sources={"0": {"source": "own-local", "holder": 0, "bytes": 3 << 30, "seconds": 4.0}},
                   failures=[{"node": 1, "source": "own-local", "holder": 1, "step": 10, "error": "bad"}]),
     ["step", "seconds", "attempts", "persistent_bytes", "bytes", "sources", "failures"]),
    (RestoreRecord(step=0, model_only=True, seconds=1.0, attempts=1, persistent_bytes=5, bytes=5, checksummed=False,
                   sources={"0": {"source": "seed", "holder": None, "bytes": 5, "seconds": 1.0}}, failures=[]),
     ["step", "seconds", "attempts", "persistent_bytes", "bytes", "sources", "failures", "model_only",
      "checksummed"]),
    (RestoreRecord(step=10, seconds=9.0, attempts=7, persistent_bytes=0, bytes=6 << 30,
                   sources={"0": {"source": "own-local", "holder": 0, "bytes": 3 << 30, "seconds": 4.0}},
                   failures=[{"node": 0, "source": "persistent", "holder": None, "step": 11, "error": "bad"}],
                   save_id="aaaaaaaaaaaa.0",
                   abandoned=[{"step": 20, "save_id": "aaaaaaaaaaaa.1", "by": "bbbbbbbbbbbb.0"}]),
     ["step", "seconds", "attempts", "persistent_bytes", "bytes", "sources", "failures", "save_id", "abandoned"]),
    (ScheduleRecord.of(DECISION, "checkpoint", 40),
     ["trigger", "at_step", "tier", "delta", "M", "R", "p", "tau_s", "tau_steps", "reason", "M_eff", "C", "step_s",
      "tau_model_s", "sources", "delta_blocking"]),
    (RollbackRecord(from_step=6, to_step=2, trigger={"tier": "local", "step": 3},
                    superseded=["persistent/6", "local node-0/4"]),
     ["from_step", "to_step", "trigger", "superseded"]),
    (PreemptionRecord(step=5, signal="SIGTERM", committed={"local": True, "persistent": False}, seconds=2.5,
                      earlier_failures=["persistent step 4: boom"]),
     ["step", "signal", "committed", "seconds", "earlier_failures"]),
    (RedundancyRecord(step=3, ok=True, nodes=[0], missing=[], seconds=0.4, bytes=1 << 20),
     ["step", "ok", "nodes", "missing", "seconds", "bytes", "error"]),
    (RedundancyRecord(step=3, ok=False, missing=[0, 1, 2], reason="resharded restore"),
     ["step", "ok", "nodes", "missing", "seconds", "bytes", "error", "reason"]),
    (RecoveryRecord(step=6, cause="node-failure", attempt=1, restart_count=1, failed_nodes=[1], warm=False,
                    replaced={}, origin="failure_noticed",
                    phases={p: 1.7e9 + i for i, p in enumerate(RECOVERY_PHASES)},
                    phases_s={p: float(i) for i, p in enumerate(RECOVERY_PHASES)}, total_s=8.0,
                    nodes={"0": {"source": "own-local", "holder": 0, "bytes": 10, "seconds": 0.2,
                                 "processes_started_s": 3.0, "imports_done_s": 4.0}}),
     ["step", "cause", "attempt", "restart_count", "failed_nodes", "warm", "replaced", "origin", "phases",
      "phases_s", "total_s", "nodes"]),
    (RecoveryRecord(step=6, cause="restart", origin="processes_started", phases_s={"processes_started": 0.0},
                    notes=["imports_done was 0.002 s before processes_started (clock skew across hosts): clamped"]),
     ["step", "cause", "attempt", "restart_count", "failed_nodes", "warm", "replaced", "origin", "phases",
      "phases_s", "total_s", "nodes", "notes"]),
]


def _ledger(tmp_path, run_id="r1") -> Ledger:
    return Ledger(Store(str(tmp_path)), enabled=True, run_id=run_id, job="j")


def test_every_kind_has_a_golden_line():
    assert {type(r) for r, _ in GOLDEN} == set(KINDS.values())


@pytest.mark.parametrize("rec,keys", GOLDEN, ids=lambda x: getattr(x, "kind", None))
def test_golden_keys_written(tmp_path, rec, keys):
    led = _ledger(tmp_path)
    line = led.append(rec)
    (raw,) = _lines(tmp_path)
    assert list(raw) == ENV + keys == list(line)
    assert raw["kind"] == rec.kind and raw["run_id"] == "r1" and raw["job"] == "j"
    if rec.kind == "checkpoint":
        assert raw["schema"] == CHECKPOINT_SCHEMA
    else:
        assert "schema" not in raw  # kinds at schema 1 write no key, as before typed records


def _lines(tmp_path) -> list[dict]:
    with open(Store(str(tmp_path)).path(LEDGER)) as f:
        return [json.loads(x) for x in f]


@pytest.mark.parametrize("rec,keys", GOLDEN, ids=lambda x: getattr(x, "kind", None))
def test_round_trip(tmp_path, rec, keys):
    assert type(rec).from_ledger(rec.as_ledger()) == rec
    led = _ledger(tmp_path)
    led.append(rec)
    (back,) = Ledger.read_records(led.store)
    assert type(back) is type(rec)
    assert back.run_id == "r1" and back.job == "j" and isinstance(back.time, float)
    assert dataclasses.replace(back, time=None, run_id=None, job=None) == rec
    assert back.as_line() == _lines(tmp_path)[0]


def test_unknown_kind_is_kept_whole(tmp_path):
    line = {"kind": "quota", "time": 5.0, "run_id": "r0", "job": "j", "used": 7, "schema": 3}
    rec = record_from_ledger(line)
    assert isinstance(rec, GenericRecord)
    assert (rec.kind, rec.time, rec.run_id, rec.job, rec.schema) == ("quota", 5.0, "r0", "j", 3)
    assert rec.as_line() == line
    led = _ledger(tmp_path)
    led.append(rec)
    raw = _lines(tmp_path)[0]
    assert raw["kind"] == "quota" and raw["used"] == 7 and raw["run_id"] == "r1"  # restamped by the writer


def test_extra_fields_are_kept_and_written_back():
    line = {"kind": "restore", "time": 1.0, "run_id": "r", "job": "j", "step": 3, "seconds": 1.5, "zone": "eu"}
    rec = record_from_ledger(line)
    assert isinstance(rec, RestoreRecord) and rec.step == 3 and rec.extra == {"zone": "eu"}
    assert rec.as_ledger()["zone"] == "eu"


def test_missing_and_ill_typed_fields_take_their_defaults():
    rec = record_from_ledger({"kind": "checkpoint", "tier": "local", "blocking_s": "fast", "bytes": -1})
    assert isinstance(rec, CheckpointRecord)
    # ok and step absent: ok (as the readers before typed records had it), step unknown
    assert (rec.ok, rec.step, rec.blocking_s, rec.bytes, rec.interference_s) == (True, None, 0.0, 0, None)
    assert (rec.time, rec.run_id, rec.job) == (None, None, None)
    start = record_from_ledger({"kind": "run_start", "time": float("nan"), "restart_count": True, "world_size": 0})
    assert (start.time, start.restart_count, start.world_size, start.process_start) == (None, None, None, None)
    end = record_from_ledger({"kind": "run_end", "exposure_s": -3})
    assert (end.clean, end.exposure_s, end.stuck_tiers) == (False, None, [])
    sched = record_from_ledger({"kind": "schedule", "tier": "local", "step_s": 0})
    assert sched.tier == "local" and sched.step_s is None


def test_a_known_kind_without_a_field_it_needs_is_kept_generic():
    rec = record_from_ledger({"kind": "checkpoint", "time": 2.0, "run_id": "r", "step": 1, "ok": True})
    assert isinstance(rec, GenericRecord) and rec.kind == "checkpoint" and rec.time == 2.0


def test_older_schemas_read():
    # a checkpoint line from before the schema key and interference_s
    old = record_from_ledger({"kind": "checkpoint", "time": 1.0, "run_id": "r", "job": "j", "tier": "persistent",
                              "step": 4, "ok": True, "error": None, "blocking_s": 0.1, "wait_s": 0.0, "bytes": 9,
                              "background_s": 3.0})
    assert isinstance(old, CheckpointRecord) and old.schema == 0 and old.interference_s is None
    assert old.as_ledger()["schema"] == CHECKPOINT_SCHEMA  # written in today's layout
    # restore sources of older layouts: "tier" for "source", bare names, lists
    for sources in ({"0": {"tier": "persistent", "holder": None}}, {"0": "persistent"}, ["persistent"]):
        rec = record_from_ledger({"kind": "restore", "step": 1, "sources": sources})
        assert rec.source_kinds() == ["persistent"]
    assert record_from_ledger({"kind": "run_start"}).schema == 1


def test_newer_schema_reads_known_fields():
    rec = record_from_ledger({"kind": "checkpoint", "schema": CHECKPOINT_SCHEMA + 1, "tier": "local", "step": 2,
                              "ok": False, "error": "e", "retries": 3})
    assert rec.schema == CHECKPOINT_SCHEMA + 1 and rec.failed and rec.extra == {"retries": 3}


def test_torn_last_line_and_junk_are_skipped(tmp_path):
    led = _ledger(tmp_path)
    led.append(RunStartRecord(restart_count=0))
    with open(led.store.path(LEDGER), "ab") as f:
        f.write(b'[1, 2]\n{"no_kind": 1}\n{"kind": "checkpoint", "time": 1.0, "run_id": "r')
    recs = Ledger.read_records(led.store)
    assert [type(r) for r in recs] == [RunStartRecord]
    led.append(RunEndRecord(clean=True))
    assert [r.kind for r in Ledger.read_records(led.store)] == ["run_start", "run_end"]


def test_parse_records_passes_records_through_and_skips_non_lines():
    rec = RunEndRecord(clean=True)
    got = parse_records([rec, {"kind": "run_start"}, {"time": 1.0}, "run_end", None])
    assert got[0] is rec and isinstance(got[1], RunStartRecord) and len(got) == 2


def test_append_takes_records_only(tmp_path):
    with pytest.raises(TypeError, match="LedgerRecord"):
        _ledger(tmp_path).append({"kind": "run_start"})


def test_journal_writes_the_engine_events(tmp_path):
    led = _ledger(tmp_path)
    j = RunJournal(led)
    j.run_start(SimpleNamespace(world_size=2, nodes=2, ranks_per_node=1, jump=1, factor=2), ("local",), "lin")
    rec = j.checkpoint("local", 3, [(True, None, 10, 1.0, 0.2), (False, "OSError: x", 5, 2.0, 0.1)],
                       wait_s=0.0, group=None, extra={"replicas_failed": ["node 1"]})
    assert (rec.ok, rec.error, rec.bytes, rec.background_s, rec.blocking_s) == (False, "OSError: x", 15, 2.0, 0.2)
    out = NodeOutcome(node=0, step=3, source=Source("own-local", 0), ok=True, bytes=7, seconds=0.5)
    bad = NodeOutcome(node=1, step=3, source=Source("peer-replica", 0), ok=False, error="bad")
    j.restore(RestoreResult(step=3, sources={0: out}, attempts=2, failures=[bad], seconds=1.0, persistent_bytes_read=0))
    j.schedule(DECISION, "restart", 3)
    j.rollback(SimpleNamespace(from_step=6, to_step=3, cause="rollback", keep=None), "local", 4,
               superseded=["persistent/6"])
    j.preemption(4, "SIGTERM", {"local": True}, 1.0, [])
    red = j.redundancy(3, ok=True, nodes={0}, missing=(), seconds=0.4, nbytes=1 << 20)
    j.run_end(clean=False, reason="", durable_step=None, stuck_tiers=[], failures=[rec], strict=True)
    lines = _lines(tmp_path)
    assert [x["kind"] for x in lines] == ["run_start", "checkpoint", "restore", "schedule", "rollback", "preemption",
                                          "redundancy", "run_end"]
    golden = {r.kind: keys for r, keys in GOLDEN
              if not getattr(r, "model_only", False) and not getattr(r, "abandoned", None)
              and not (r.kind == "redundancy" and r.reason)}
    assert [list(x)[4:] for x in lines[2:7]] == [golden[k] for k in ("restore", "schedule", "rollback", "preemption",
                                                                     "redundancy")]
    assert red == RedundancyRecord(step=3, ok=True, nodes=[0], seconds=0.4, bytes=1 << 20)
    assert (lines[6]["step"], lines[6]["ok"], lines[6]["nodes"], lines[6]["missing"]) == (3, True, [0], [])
    assert lines[2]["sources"] == {"0": {"source": "own-local", "holder": 0, "bytes": 7, "seconds": 0.5}}
    assert lines[2]["failures"] == [{"node": 1, "source": "peer-replica", "holder": 0, "step": 3, "error": "bad"}]
    assert lines[7]["failures"] == [{"tier": "local", "step": 3, "error": "OSError: x"}]
    assert lines[7]["exposure_s"] >= 0 and "stuck_tiers" not in lines[7]


def test_recovery_record_reader_is_tolerant():
    line = {"kind": "recovery", "time": 5.0, "run_id": "r", "job": "j", "step": "six", "cause": 3, "attempt": -1,
            "total_s": -2.0, "phases": [1], "phases_s": {"failure_noticed": 0.0, "launched": "soon", "later": 1.5},
            "warm": "no", "notes": "x", "future_key": 1}
    rec = record_from_ledger(line)
    assert isinstance(rec, RecoveryRecord)
    assert (rec.step, rec.cause, rec.attempt, rec.total_s, rec.phases, rec.warm, rec.notes) == (
        None, "unknown", None, None, {}, None, [])
    assert rec.extra == {"future_key": 1}
    rows = dict(rec.phase_rows())
    assert list(rows)[:len(RECOVERY_PHASES)] == list(RECOVERY_PHASES) and list(rows)[-1] == "later"
    assert rows["failure_noticed"] == 0.0 and rows["launched"] is None and rows["later"] == 1.5
    assert rows["first_step_done"] is None


def test_journal_names_the_abandoned_saves_a_restore_skipped(tmp_path):
    j = RunJournal(_ledger(tmp_path))
    out = NodeOutcome(node=0, step=10, source=Source("own-local", 0), ok=True, bytes=7, seconds=0.5)
    skipped = [{"step": 20, "save_id": "aaaaaaaaaaaa.1", "by": "bbbbbbbbbbbb.0"}]
    j.restore(RestoreResult(step=10, sources={0: out}, attempts=3, failures=[], seconds=1.0, persistent_bytes_read=0,
                            save_id="aaaaaaaaaaaa.0", abandoned=skipped))
    (line,) = _lines(tmp_path)
    assert line["abandoned"] == skipped and list(line)[-2:] == ["save_id", "abandoned"]
    assert record_from_ledger(line).abandoned == skipped
