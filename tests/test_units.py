"""Unit tests (no torch.distributed) of config, manifest, layout, storage and ledger."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest

from tierckpt.io import layout, manifest
from tierckpt.config import TIERS, TierConfig
from tierckpt.errors import ConfigError, VerificationError
from tierckpt.history.ledger import Ledger, summarize
from tierckpt.records import CheckpointRecord, RestoreRecord, RunEndRecord, RunStartRecord
from tierckpt.io.storage import Store


# -- config ------------------------------------------------------------------------------------
def cfg(**kw) -> TierConfig:
    base = dict(local_root="/nvme/{job}/node-{node}", persistent_root="/lustre/run")
    base.update(kw)
    return TierConfig(**base)


def test_config_valid_defaults():
    c = cfg()
    assert c.tiers == TIERS
    assert c.keep_latest_k == {"local": 2, "persistent": 3}
    c = cfg(tiers=["persistent"], local_root=None, keep_latest_k={"local": 0})
    assert c.tiers == ("persistent",) and c.keep_latest_k == {"local": 0, "persistent": 3}


def test_config_unknown_tier_names_option_and_allowed():
    with pytest.raises(ConfigError) as ei:
        cfg(tiers=("local", "nvme"))
    msg = str(ei.value)
    assert ei.value.option == "tiers"
    assert msg.startswith("tiers:") and "'nvme'" in msg
    assert all(t in msg for t in TIERS)


def test_config_empty_tiers():
    with pytest.raises(ConfigError, match="^tiers:.*local, persistent"):
        cfg(tiers=())


def test_config_negative_keep_latest_k():
    with pytest.raises(ConfigError) as ei:
        cfg(keep_latest_k={"local": -1})
    assert ei.value.option == "keep_latest_k.local"
    assert "keep_latest_k.local" in str(ei.value) and ">= 0" in str(ei.value)


def test_config_keep_latest_k_unknown_tier():
    with pytest.raises(ConfigError, match="^keep_latest_k:.*'ram'.*local, persistent"):
        cfg(keep_latest_k={"ram": 1})


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_config_replication_factor(bad):
    with pytest.raises(ConfigError) as ei:
        cfg(replication_factor=bad)
    assert ei.value.option == "replication_factor"
    assert "replication_factor" in str(ei.value) and ">= 1" in str(ei.value)


def test_config_local_root_without_node():
    with pytest.raises(ConfigError) as ei:
        cfg(local_root="/nvme/{job}/ckpt")
    assert ei.value.option == "local_root" and "{node}" in str(ei.value)
    # allowed when each node's path is on its own disk, or with {hostname}
    cfg(local_root="/nvme/{job}/ckpt", local_root_is_node_private=True)
    cfg(local_root="/nvme/{hostname}")


def test_config_local_root_unknown_field():
    with pytest.raises(ConfigError) as ei:
        cfg(local_root="/nvme/{rank}/node-{node}")
    msg = str(ei.value)
    assert ei.value.option == "local_root" and "rank" in msg and "{job}" in msg and "{node}" in msg


def test_config_local_root_malformed_and_missing():
    with pytest.raises(ConfigError, match="^local_root:.*malformed"):
        cfg(local_root="/nvme/{node")
    with pytest.raises(ConfigError, match="^local_root:"):
        cfg(local_root=None)


def test_config_missing_persistent_root():
    with pytest.raises(ConfigError) as ei:
        cfg(persistent_root=None)
    assert ei.value.option == "persistent_root"
    with pytest.raises(ConfigError, match="^persistent_root:"):
        cfg(persistent_root="")


def test_config_local_root_for():
    c = cfg(job_id="4242")
    assert c.local_root_for(3) == "/nvme/4242/node-3"


def test_config_is_frozen_and_replace_revalidates():
    import copy
    import dataclasses
    import pickle

    c = cfg(intervals={"local": 5, "persistent": 10})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.replication_factor = 3
    for mapping in (c.keep_latest_k, c.intervals):
        with pytest.raises(TypeError):
            mapping["local"] = 1
        with pytest.raises(TypeError):
            mapping.update(local=1)
    assert c.keep_latest_k == {"local": 2, "persistent": 3} and c.intervals == {"local": 5, "persistent": 10}
    assert isinstance(c.tiers, tuple) and isinstance(c.warn_only, tuple)
    assert pickle.loads(pickle.dumps(c)) == c and copy.deepcopy(c) == c and hash(c) == hash(copy.copy(c))
    assert json.loads(json.dumps(c.keep_latest_k)) == {"local": 2, "persistent": 3}
    assert c.replace(job_id="j2").job_id == "j2"
    with pytest.raises(ConfigError) as ei:
        c.replace(replication_factor=0)
    assert ei.value.option == "replication_factor"
    with pytest.raises(ConfigError) as ei:
        cfg(replication_factr=2)
    assert ei.value.option == "replication_factr" and "replication_factor" in str(ei.value)


def test_schedule_options_typo_and_bounds_fail_at_construction():
    from tierckpt import ScheduleOptions

    with pytest.raises(ConfigError) as ei:
        ScheduleOptions(gpu_mtbf=3600.0)
    msg = str(ei.value)
    assert ei.value.option == "schedule.gpu_mtbf"
    assert all(n in msg for n in ("gpu_mtbf_s", "mtbf_weight", "min_steps", "max_steps", "min_s", "max_s",
                                  "restart_prior_s", "persistent_share"))
    with pytest.raises(ConfigError) as ei:
        ScheduleOptions(min_steps={"local": 0})
    assert ei.value.option == "min_steps.local" and ">= 1" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        ScheduleOptions(min_s=10, max_s={"persistent": 5})
    assert ei.value.option == "min_s" and "min_s <= max_s" in str(ei.value)
    with pytest.raises(ConfigError, match="^schedule:.*ScheduleOptions"):
        cfg(schedule={"gpu_mtbf_s": 3600.0})
    opts = ScheduleOptions(min_s={"local": 3, "persistent": None}, max_steps=9, gpu_mtbf_s=3600)
    assert opts.min_s == {"local": 3.0} and opts.gpu_mtbf_s == 3600.0
    with pytest.raises(TypeError):
        opts.min_s["persistent"] = 1.0
    assert cfg(schedule=opts).schedule is opts


# -- layout ------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [0, 1, 10, 123456789])
def test_step_name_round_trip(step):
    assert layout.parse_step(layout.step_name(step)) == step


def test_step_name_rejects_negative():
    with pytest.raises(ValueError):
        layout.step_name(-1)


@pytest.mark.parametrize("name", ["step--1", "step-", "step-1a", "step-1.tmp", "Step-1", "node-1", "step-+1", " step-1"])
def test_parse_step_rejects(name):
    assert layout.parse_step(name) is None


def test_layout_paths():
    assert layout.local_step(5) == "local/step-5"
    assert layout.replica_step(2, 5) == "replicas/node-2/step-5"
    assert layout.persistent_step(5) == "step-5"
    assert layout.parse_node("node-7") == 7 and layout.parse_node("node-x") is None


# -- manifest ----------------------------------------------------------------------------------
def make_step(store: Store, step_rel: str, files: dict[str, bytes]) -> list[manifest.FileEntry]:
    for name, data in files.items():
        with store.open(f"{step_rel}/{name}", "wb") as f:
            f.write(data)
    step_store = store.sub(step_rel)
    return [manifest.hash_file(step_store, name) for name in files]


FILES = {"__0_0.distcp": bytes(range(256)) * 64, ".metadata": b"md", "sub/__1_0.distcp": b"z" * 100}


def test_commit_then_read_committed(tmp_path):
    store = Store(str(tmp_path))
    entries = make_step(store, "step-3", FILES)
    doc = manifest.commit(store, "step-3", entries, tier="persistent", step=3)
    assert manifest.read_committed(store, "step-3") == doc
    assert doc["tier"] == "persistent" and doc["step"] == 3
    assert doc["total_bytes"] == sum(len(v) for v in FILES.values())
    assert sorted(f["path"] for f in doc["files"]) == sorted(FILES)
    assert manifest.verify_step(store, "step-3") == []
    assert sorted(manifest.data_files(store, "step-3")) == sorted(FILES)
    marker = json.loads(store.read_bytes(f"step-3/{layout.MARKER}"))
    assert marker["tier"] == "persistent" and marker["step"] == 3


def test_uncommitted_step_reads_none(tmp_path):
    store = Store(str(tmp_path))
    make_step(store, "step-1", FILES)
    assert manifest.read_committed(store, "step-1") is None
    assert manifest.read_committed(store, "step-404") is None
    assert "not committed" in manifest.verify_step(store, "step-1")[0]


def test_marker_not_matching_manifest(tmp_path):
    store = Store(str(tmp_path))
    entries = make_step(store, "step-1", FILES)
    manifest.commit(store, "step-1", entries, tier="local", step=1, node=0)
    # the manifest is replaced after the commit: same format, other bytes
    other = manifest.manifest_bytes(entries[:1], tier="local", step=1, node=0)
    store.write_atomic(f"step-1/{layout.MANIFEST}", other)
    assert manifest.read_committed(store, "step-1") is None


@pytest.mark.parametrize("marker", [b"[1, 2]", b"not json", b"", b"null"])
def test_garbage_marker_is_not_committed(tmp_path, marker):
    store = Store(str(tmp_path))
    entries = make_step(store, "step-1", FILES)
    manifest.commit(store, "step-1", entries, tier="local", step=1, node=0)
    store.write_atomic(f"step-1/{layout.MARKER}", marker)
    assert manifest.read_committed(store, "step-1") is None


def test_uncommit_removes_marker(tmp_path):
    store = Store(str(tmp_path))
    entries = make_step(store, "step-1", FILES)
    manifest.commit(store, "step-1", entries, tier="local", step=1, node=0)
    manifest.uncommit(store, "step-1")
    assert manifest.read_committed(store, "step-1") is None


def test_verify_files_detects_size_change_and_bit_flip(tmp_path):
    store = Store(str(tmp_path))
    entries = make_step(store, "step-1", FILES)
    assert manifest.verify_files(store, "step-1", entries) == []
    p = Path(store.path("step-1/__0_0.distcp"))
    data = bytearray(p.read_bytes())
    data[4000] ^= 0x80
    p.write_bytes(bytes(data))
    problems = manifest.verify_files(store, "step-1", entries)
    assert len(problems) == 1 and "__0_0.distcp" in problems[0] and "xxh3_64" in problems[0]
    with open(store.path("step-1/sub/__1_0.distcp"), "ab") as f:
        f.write(b"!")
    problems = manifest.verify_files(store, "step-1", entries)
    assert len(problems) == 2 and any("size 101 != manifest 100" in p for p in problems)
    Path(store.path("step-1/.metadata")).unlink()
    problems = manifest.verify_files(store, "step-1", entries)
    assert len(problems) == 3 and any(".metadata: missing" in p for p in problems)
    with pytest.raises(VerificationError, match="xxh3_64"):
        manifest.require_intact(store, "step-1", entries)


def test_hash_stream_chunks_match_whole():
    import io

    import xxhash

    data = bytes(range(256)) * 1000
    n, digest = manifest.hash_stream(io.BytesIO(data), bytearray(1000))
    assert n == len(data) and digest == xxhash.xxh3_64_hexdigest(data)


# -- storage -----------------------------------------------------------------------------------
@pytest.fixture(params=["file", "memory"])
def url_store(request, tmp_path):
    if request.param == "file":
        yield Store(f"file://{tmp_path}/root")
        return
    store = Store(f"memory://tierckpt-units-{uuid.uuid4().hex}/root")
    yield store
    store.rmtree("")


def test_store_file_url_is_local(tmp_path):
    s = Store(f"file://{tmp_path}")
    assert s.local and s.root == str(tmp_path) and s.url_of("a") == f"{tmp_path}/a"


def test_store_operations(url_store):
    s = url_store
    s.write_atomic("a/b/c.bin", b"hello")
    s.write_atomic("a/d.bin", b"xy")
    s.write_atomic("a/d.bin", b"xyz")  # overwrite
    assert s.read_bytes("a/b/c.bin") == b"hello"
    assert s.read_bytes("a/d.bin") == b"xyz" and s.size("a/d.bin") == 3
    assert s.exists("a/b") and s.isdir("a/b") and not s.isdir("a/d.bin")
    assert s.listdir("") == ["a"]
    assert s.listdir("a") == ["b", "d.bin"]
    assert s.listdir("a/d.bin") == []  # a file has no entries
    assert s.listdir("missing") == []
    assert list(s.walk_files("")) == ["a/b/c.bin", "a/d.bin"]
    assert list(s.walk_files("a")) == ["b/c.bin", "d.bin"]
    assert not [p for p in s.walk_files("") if p.endswith(".tmp")]
    sub = s.sub("a")
    assert sub.read_bytes("b/c.bin") == b"hello"
    s.rename("a/d.bin", "a/e.bin")
    assert s.listdir("a") == ["b", "e.bin"]
    s.remove("a/e.bin")
    s.remove("a/e.bin")  # missing is fine
    s.rmtree("a/b")
    assert not s.exists("a/b/c.bin") and list(s.walk_files("")) == []
    s.rmtree("never-there")
    with pytest.raises(FileNotFoundError):
        s.read_bytes("a/b/c.bin")


def test_store_manifest_round_trip(url_store):
    entries = make_step(url_store, "step-9", FILES)
    doc = manifest.commit(url_store, "step-9", entries, tier="persistent", step=9)
    assert manifest.read_committed(url_store, "step-9") == doc
    assert manifest.verify_step(url_store, "step-9") == []
    with url_store.open("step-9/.metadata", "wb") as f:
        f.write(b"mD")
    assert ".metadata" in manifest.verify_step(url_store, "step-9")[0]


# -- ledger ------------------------------------------------------------------------------------
def write_runs(store: Store) -> None:
    a = Ledger(store, enabled=True, run_id="a", job="j")
    a.append(RunStartRecord(world_size=2, nodes=1, ranks_per_node=2, restart_count=0, host="h"))
    a.append(CheckpointRecord(tier="local", step=1, blocking_s=0.2, background_s=1.0, bytes=100, ok=True))
    b = Ledger(store, enabled=True, run_id="b", job="j")
    b.append(RunStartRecord(world_size=2, nodes=1, ranks_per_node=2, restart_count=1, host="h"))
    b.append(RestoreRecord(step=1, sources={"0": {"tier": "local", "holder": 0}}, bytes=100,
                           seconds=0.5, attempts=1, persistent_bytes=0))
    b.append(CheckpointRecord(tier="local", step=2, blocking_s=0.4, background_s=3.0, bytes=200, ok=True))
    b.append(CheckpointRecord(tier="persistent", step=2, blocking_s=0.1, background_s=9.0, bytes=0,
                              ok=False, error="boom"))
    b.append(RunEndRecord(clean=True, exposure_s=60.0, reason="done"))


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_ledger_append_read_summarize(tmp_path, kind):
    url = str(tmp_path) if kind == "file" else f"memory://tierckpt-ledger-{uuid.uuid4().hex}"
    store = Store(url)
    try:
        write_runs(store)
        recs = Ledger.read(store)
        assert [r["kind"] for r in recs] == [
            "run_start", "checkpoint", "run_start", "restore", "checkpoint", "checkpoint", "run_end"]
        assert all({"time", "run_id", "job"} <= set(r) for r in recs)
        s = summarize(recs)
        assert [r["run_id"] for r in s["runs"]] == ["a", "b"]
        assert [r["run_id"] for r in s["failures"]] == ["a"]
        assert s["runs"][1]["exposure_s"] == 60.0 and s["runs"][1]["restart_count"] == 1
        loc = s["checkpoints"]["local"]
        assert (loc["count"], loc["ok"], loc["last_step"], loc["last_bytes"]) == (2, 2, 2, 200)
        assert loc["mean_blocking_s"] == pytest.approx(0.3)
        assert loc["mean_background_s"] == pytest.approx(2.0)
        per = s["checkpoints"]["persistent"]
        assert (per["ok"], per["failed"], per["mean_blocking_s"]) == (0, 1, None)
        assert len(s["restores"]) == 1
        # a torn tail (a torn record object) is skipped on read and terminated by the next append
        if kind == "file":
            with store.open(layout.LEDGER, "rb") as f:
                raw = f.read()
            store.write_atomic(layout.LEDGER, raw + b'{"kind": "run_end", "cle')
        else:  # an object store: one object per record, none rewritten
            assert not store.exists(layout.LEDGER) and len(store.listdir(layout.LEDGER_DIR)) == 7
            store.write_atomic(f"{layout.LEDGER_DIR}/000000000007-x-torn.json", b'{"kind": "run_end", "cle')
        assert len(Ledger.read(store)) == 7
        Ledger(store, enabled=True, run_id="c", job="j").append(RunStartRecord(restart_count=2))
        recs = Ledger.read(store)
        assert len(recs) == 8 and recs[-1]["run_id"] == "c"
        assert [r["run_id"] for r in summarize(recs)["failures"]] == ["a", "c"]
    finally:
        if kind == "memory":
            store.rmtree("")


def test_ledger_disabled_writes_nothing(tmp_path):
    store = Store(str(tmp_path))
    rec = Ledger(store, enabled=False, run_id="r", job="j").append(RunStartRecord(restart_count=0))
    assert rec["kind"] == "run_start" and rec["run_id"] == "r"
    assert not store.exists(layout.LEDGER) and Ledger.read(store) == []


def test_ledger_serialises_non_json_values(tmp_path):
    store = Store(str(tmp_path))

    class Scalar:
        def item(self):
            return 7

    Ledger(store, enabled=True, run_id="r", job="j").append(
        CheckpointRecord(tier="local", step=Scalar(), ok=True, extra={"ranks": {3, 1}, "where": Path("/x")}))
    (rec,) = Ledger.read(store)
    assert rec["step"] == 7 and sorted(rec["ranks"]) == [1, 3] and rec["where"] == "/x"


def test_ledger_records_reads_the_file_once_then_mirrors_own_appends(tmp_path, monkeypatch):
    store = Store(str(tmp_path))
    old = Ledger(store, enabled=True, run_id="r0", job="j")
    old.append(RunStartRecord())
    old.append(RunEndRecord(clean=False))
    led = Ledger(store, enabled=True, run_id="r1", job="j")
    led.append(RunStartRecord(restart_count=1))  # written before the first records(): not twice
    reads = []
    real = Ledger.read
    monkeypatch.setattr(Ledger, "read", staticmethod(lambda s: reads.append(1) or real(s)))
    first = led.records()
    led.append(CheckpointRecord(tier="local", step=5, ok=True, blocking_s=0.1))
    led.append(RestoreRecord(step=5, sources={"0": {"source": "own-local"}}))
    second = led.records()
    assert len(reads) == 1, "the ledger file was read again"
    assert [r["kind"] for r in first] == ["run_start", "run_end", "run_start"]
    assert second == real(store)  # the mirror equals what a reader of the file sees
    assert [r["kind"] for r in second][-2:] == ["checkpoint", "restore"]


# -- lineage -----------------------------------------------------------------------------------
def _local_step(store: Store, rel: str, lid: str | None) -> None:
    with store.open(f"{rel}/__0_0.distcp", "wb") as f:
        f.write(b"x" * 8)
    manifest.commit(store, rel, [manifest.hash_file(store.sub(rel), "__0_0.distcp")], tier="local",
                    **({"lineage": lid} if lid else {}))


def test_lineage_is_created_once_per_persistent_root(tmp_path):
    from tierckpt.history import lineage

    store = Store(str(tmp_path / "pfs"))
    lid, created, adopt = lineage.ensure(store)
    assert created and not adopt  # a new experiment owns no unlabelled steps
    assert lineage.ensure(store) == (lid, False, False) and lid == lineage.read(store)
    doc = json.loads(store.read_bytes(layout.LINEAGE))
    assert doc["persistent_root"] == store.url and doc["created"] > 0
    store.rmtree("")  # the root deleted and created again: another experiment
    assert lineage.ensure(store)[0] != lid
    # a root that already holds an experiment (its ledger predates lineages) adopts the
    # node-local steps that record no lineage: upgrading never makes them foreign
    old = Store(str(tmp_path / "old"))
    old.write_atomic("tierckpt-ledger.jsonl", b"{}\n")
    lid2, created, adopt = lineage.ensure(old)
    assert created and adopt and lineage.ensure(old) == (lid2, False, True)
    assert not lineage.is_foreign({"lineage": None}, lid2, adopt_unlabelled=True)
    assert lineage.is_foreign({}, lid2) and lineage.is_foreign({"lineage": "x"}, lid2, adopt_unlabelled=True)


def test_unreadable_lineage_file_is_never_replaced(tmp_path):
    from tierckpt.history import lineage

    store = Store(str(tmp_path))
    store.write_atomic(layout.LINEAGE, b"{torn")
    with pytest.raises(ConfigError, match="persistent_root:.*tierckpt-lineage.json.*delete it"):
        lineage.ensure(store)
    assert store.read_bytes(layout.LINEAGE) == b"{torn"


def test_local_steps_of_another_or_no_lineage_are_foreign_and_purged(tmp_path):
    from tierckpt.tiers import retention
    from tierckpt.tiers.local_tier import LocalTier

    store = Store(str(tmp_path))
    mine, other = "a" * 32, "b" * 32
    _local_step(store, layout.local_step(2), mine)
    _local_step(store, layout.local_step(3), other)
    _local_step(store, layout.local_step(4), None)  # written before lineages existed
    _local_step(store, layout.replica_step(1, 2), mine)
    _local_step(store, layout.replica_step(1, 9), other)
    tier = LocalTier(store, None, None, lineage=mine)
    own, reps, foreign = tier.scan()
    assert own == [2] and reps == {1: [2]}
    assert sorted(foreign) == [("local/step-3", other), ("local/step-4", None), ("replicas/node-1/step-9", other)]
    assert tier.committed_steps() == [2] and tier.committed_replicas() == {1: [2]}
    # retention after a save: foreign steps never count towards k (never push out own steps)
    _local_step(store, layout.local_step(1), mine)
    out = retention.purge_local(store, 1, retention.InUse(), lineage_id=mine, drop_foreign=False)
    assert out == {"local": [1], "node-1": []}
    assert sorted(store.listdir("local")) == ["step-2", "step-3", "step-4"]
    # the purge at start: foreign steps go, own ones stay
    out = retention.purge_local(store, 1, retention.InUse(), lineage_id=mine)
    assert out == {"local": [3, 4], "node-1": [9]}
    assert sorted(store.listdir("local")) == ["step-2"] and store.listdir("replicas/node-1") == ["step-2"]
    assert LocalTier(store, None, None).scan() == ([2], {1: [2]}, [])


def test_preemption_watch_records_duplicates_and_escalates_a_late_repeat():
    """A repeated notice within ``escalate_after_s`` is the same notice (Slurm signals every
    process of a step and torchrun forwards SIGTERM to its workers: a worker gets it twice);
    a repeat after it gets the signal's previous action, so a stuck trainer can still die."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, signal, sys, time
        from tierckpt.preemption import PreemptionWatch
        w = PreemptionWatch(("SIGUSR1",), escalate_after_s=0.5)
        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.05)
        print("recorded", w.received, flush=True)
        time.sleep(0.6)
        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(1.0)
        print("survived", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "recorded SIGUSR1" in r.stdout and "survived" not in r.stdout, (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGUSR1, r.returncode


def test_preemption_signal_names_are_checked():
    from tierckpt.preemption import signal_numbers

    assert signal_numbers(["SIGTERM", "USR1"]) == (int(signal.SIGTERM), int(signal.SIGUSR1))
    with pytest.raises(ConfigError, match="preemption_signals.*SIGKILL"):
        signal_numbers(["SIGKILL"])
    with pytest.raises(ConfigError, match="preemption_signals"):
        signal_numbers(["SIGNOPE"])


def test_on_disk_names_are_stable():
    """The names of the commit files, the ledger and the lineage file are the on-disk format:
    existing checkpoints and tools depend on them (a refactor once renamed the manifest)."""
    from tierckpt.io import layout

    assert (layout.MANIFEST, layout.MARKER, layout.INPROGRESS, layout.LEDGER, layout.LINEAGE) == (
        "tierckpt.manifest.json", "tierckpt.committed", "tierckpt.inprogress", "tierckpt-ledger.jsonl",
        "tierckpt-lineage.json")
    assert (layout.local_step(7), layout.replica_step(2, 7), layout.persistent_step(7)) == (
        "local/step-7", "replicas/node-2/step-7", "step-7")


def test_package_structure_rules():
    """Issue 11's rules, checked on the source: tierckpt/ imports no adapter or framework (not
    even lazily), no import cycle between its modules, and no function in the shipped packages
    is longer than 80 lines. Issue 30's: every module is in a wing of the order
    (tierckpt_dev/shape_check.py: WING_ORDER, docs/architecture.md), a wing imports only
    wings below it (or its own), and the adapters import tierckpt only through its public
    surface, tierckpt.integration and the documented extension points."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    forbidden = ("titan_plugin", "mcore_plugin", "tierckpt_dev", "torchtitan", "megatron")
    graph: dict[str, set[str]] = {}
    for f in (root / "tierckpt").rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for n in ast.walk(ast.parse(f.read_text())):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) else []
            for m in mods:
                assert not m.startswith(forbidden), f"{f}: imports {m}"
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("tierckpt"):
                deps |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
        graph[name] = deps
    graph = {k: {d for d in v if d in graph and d != k and not k.startswith(d + ".")} for k, v in graph.items()}
    from tierckpt_dev.shape_check import WING_ORDER

    level = {member: i for i, (_, members) in enumerate(WING_ORDER) for member in members}

    def wing(module: str) -> int:
        first = module.split(".")[1] if "." in module else "__init__"
        assert first in level, f"{module} is in no wing of WING_ORDER"
        return level[first]

    upward = sorted(f"{k} -> {d}" for k, v in graph.items() for d in v if wing(d) > wing(k))
    assert not upward, f"imports up the wing order: {upward}"
    # the adapters import tierckpt only through tierckpt, tierckpt.integration and the extension
    # points tierckpt.io(.*) and tierckpt.cli (docs/architecture.md, "Adapters")
    from tierckpt_dev.shape_check import check_adapter_imports

    adapters = check_adapter_imports(root)
    assert adapters.ok, adapters.line
    state: dict[str, int] = {}

    def visit(v, path):
        state[v] = 1
        for w in graph[v]:
            assert state.get(w) != 1, f"import cycle: {' -> '.join(path + [v, w])}"
            if w not in state:
                visit(w, path + [v])
        state[v] = 2

    for v in graph:
        if v not in state:
            visit(v, [])
    long = []
    for pkg in ("tierckpt", "titan_plugin", "mcore_plugin"):
        for f in (root / pkg).rglob("*.py"):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80:
                    long.append(f"{f.relative_to(root)}:{n.lineno} {n.name}")
    assert not long, long


def test_crc32_off_holds_on_every_thread_that_saves_at_once():
    """torch keeps the zip-CRC option per thread: two tier threads inside crc32_off() at the same
    time must both write without the CRC, and each gets its own setting back (a process-wide
    reference count left the second thread computing the CRC)."""
    import threading

    from torch.serialization import get_crc32_options

    from tierckpt.io.dcp_io import crc32_off

    inside, release, seen = threading.Barrier(2), threading.Event(), {}

    def tier(name):
        with crc32_off():
            inside.wait(timeout=30)
            seen[name] = get_crc32_options()
            release.wait(timeout=30)
        seen[name + "-after"] = get_crc32_options()

    threads = [threading.Thread(target=tier, args=(n,)) for n in ("local", "persistent")]
    for t in threads:
        t.start()
    import time

    deadline = time.monotonic() + 30
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"local": False, "persistent": False, "local-after": True, "persistent-after": True}, seen
    assert get_crc32_options() is True
