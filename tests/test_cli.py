"""Tests of the ``tierckpt`` command line (ls, verify, ledger) on real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tierckpt import cli
from tierckpt.io import manifest
from tierckpt.io.layout import LEDGER, MANIFEST, local_step, persistent_step, replica_step
from tierckpt.history.ledger import Ledger
from tierckpt.records import RECOVERY_PHASES, CheckpointRecord, RecoveryRecord, RestoreRecord, RunEndRecord, RunStartRecord
from tierckpt.io.storage import Store

REPO = Path(__file__).resolve().parents[1]


def write_step(store: Store, step_rel: str, files: dict[str, bytes], commit: bool = True, **meta) -> None:
    """Write ``files`` into ``step_rel`` of ``store`` and (optionally) commit them."""
    for name, data in files.items():
        with store.open(f"{step_rel}/{name}", "wb") as f:
            f.write(data)
    if commit:
        step_store = store.sub(step_rel)
        entries = [manifest.hash_file(step_store, name) for name in sorted(files)]
        manifest.commit(store, step_rel, entries, **meta)


def dcp_files(seed: int, size: int = 4096) -> dict[str, bytes]:
    body = bytes((seed * 31 + i) % 251 for i in range(size))
    return {"__0_0.distcp": body, "__1_0.distcp": body[::-1][: size // 2], ".metadata": b"meta-%d" % seed}


@pytest.fixture
def tree(tmp_path: Path) -> dict:
    """Two node roots, one replica, a persistent root, and one torn (uncommitted) local step.

    Layout::

        job/nodes/node-0/local/step-10            committed, node 0
        job/nodes/node-0/local/step-20            torn: data only, no manifest/marker
        job/nodes/node-0/replicas/node-1/step-10  byte copy of node 1's step 10
        job/nodes/node-1/local/step-10            committed, node 1
        job/persist/step-10                       committed, persistent
    """
    job = tmp_path / "job"
    n0 = Store(str(job / "nodes" / "node-0"))
    n1 = Store(str(job / "nodes" / "node-1"))
    persist = Store(str(job / "persist"))
    write_step(n0, local_step(10), dcp_files(0), tier="local", step=10, node=0)
    write_step(n0, local_step(20), dcp_files(5), commit=False)
    write_step(n1, local_step(10), dcp_files(1), tier="local", step=10, node=1)
    shutil.copytree(n1.path(local_step(10)), n0.path(replica_step(1, 10)))
    write_step(persist, persistent_step(10), dcp_files(2, 8192), tier="persistent", step=10)
    return {"job": job, "n0": n0, "n1": n1, "persist": persist}


def run_json(capsys, *argv) -> tuple[int, object]:
    rc = cli.main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


# -- ls ----------------------------------------------------------------------------------------
def test_ls_lists_every_tier(tree, capsys):
    rc, rows = run_json(capsys, "ls", str(tree["job"]))
    assert rc == 0
    assert all(
        set(r) == {"tier", "node", "source_node", "step", "committed", "lineage", "foreign", "save_id",
                   "save_order", "newest", "abandoned", "kept_because", "files", "bytes", "path"}
        for r in rows
    )
    got = [(r["tier"], r["node"], r["source_node"], r["step"], r["committed"]) for r in rows]
    assert got == [
        ("local", 0, None, 10, True),
        ("local", 0, None, 20, False),
        ("local", 1, None, 10, True),
        ("replica", 0, 1, 10, True),
        ("persistent", None, None, 10, True),
    ]
    by_path = {r["path"]: r for r in rows}
    p_local = tree["n0"].path(local_step(10))
    assert by_path[p_local]["files"] == 3
    assert by_path[p_local]["bytes"] == sum(len(v) for v in dcp_files(0).values())
    torn = by_path[tree["n0"].path(local_step(20))]
    assert torn["files"] == 3 and torn["bytes"] == sum(len(v) for v in dcp_files(5).values())
    assert by_path[tree["persist"].path("step-10")]["bytes"] == sum(len(v) for v in dcp_files(2, 8192).values())


def test_ls_table_and_single_node_root(tree, capsys):
    assert cli.main(["ls", tree["n0"].root]) == 0
    out = capsys.readouterr().out
    assert "replica of node 1" in out
    assert "step directories, 2 committed, 1 uncommitted" in out
    assert "KiB" in out
    # node inferred from the path (node-0) when the step is not committed
    rc, rows = run_json(capsys, "ls", tree["n0"].root)
    torn = [r for r in rows if r["step"] == 20]
    assert torn == [dict(torn[0], tier="local", node=0, committed=False)]


def test_ls_does_not_descend_into_step_dirs(tree, capsys):
    # a directory named like a step nested inside a step is data, not another step
    nested = tree["persist"].path("step-10/step-99")
    os.makedirs(nested)
    rc, rows = run_json(capsys, "ls", str(tree["job"]))
    assert rc == 0
    assert 99 not in [r["step"] for r in rows]


def test_ls_on_fsspec_memory_url(capsys):
    url = f"memory://tierckpt-cli-{uuid.uuid4().hex}"
    store = Store(url)
    try:
        write_step(store, "node-3/" + local_step(7), dcp_files(3), tier="local", step=7, node=3)
        write_step(store, "persist/step-7", dcp_files(4), tier="persistent", step=7)
        rc, rows = run_json(capsys, "ls", url)
        assert rc == 0
        assert [(r["tier"], r["node"], r["step"], r["committed"]) for r in rows] == [
            ("local", 3, 7, True),
            ("persistent", None, 7, True),
        ]
        assert all(r["path"].startswith("memory://") for r in rows)
        assert cli.main(["verify", url]) == 0
    finally:
        store.rmtree("")


def test_ls_lineage_marks_steps_restore_ignores(tree, capsys):
    from tierckpt.history import lineage

    lid = lineage.ensure(tree["persist"])[0]
    n1 = tree["n1"]
    shutil.rmtree(n1.path(local_step(10)))
    write_step(n1, local_step(10), dcp_files(1), tier="local", step=10, node=1, lineage=lid)
    rc, rows = run_json(capsys, "ls", str(tree["job"]), "--lineage", tree["persist"].root)
    assert rc == 0
    got = [(r["tier"], r["node"], r["step"], r["committed"], r["lineage"], r["foreign"]) for r in rows]
    assert got == [
        ("local", 0, 10, True, None, True),       # no lineage recorded: not this job's
        ("local", 0, 20, False, None, False),     # uncommitted: nothing to mark
        ("local", 1, 10, True, lid, False),
        ("replica", 0, 10, True, None, True),
        ("persistent", None, 10, True, None, False),  # a persistent step is restorable anyway
    ]
    assert cli.main(["ls", str(tree["job"]), "--lineage", lid]) == 0
    out = capsys.readouterr().out
    assert "yes, other lineage" in out and "2 committed of another lineage" in out
    assert cli.main(["ls", str(tree["job"]), "--lineage", str(tree["job"])]) == 2
    assert "--lineage" in capsys.readouterr().err


def test_ls_marks_the_newest_save_by_save_order_not_by_step(tmp_path, capsys):
    """After a rollback to 10 whose supersede did not happen, the abandoned step 20 (older save)
    is not the newest: the new timeline's step 11 is, and ls says so (issue 28)."""
    persist = Store(str(tmp_path / "persist"))
    write_step(persist, persistent_step(10), dcp_files(1), tier="persistent", step=10,
               save_id="aaaaaaaaaaaa.0", save_order=[0, 0])
    write_step(persist, persistent_step(20), dcp_files(2), tier="persistent", step=20,
               save_id="aaaaaaaaaaaa.1", save_order=[0, 1])
    write_step(persist, persistent_step(11), dcp_files(3), tier="persistent", step=11,
               save_id="bbbbbbbbbbbb.0", save_order=[1, 0])
    rc, rows = run_json(capsys, "ls", persist.root)
    assert rc == 0
    got = {r["step"]: (r["save_id"], r["save_order"], r["newest"]) for r in rows}
    assert got == {10: ("aaaaaaaaaaaa.0", [0, 0], False), 11: ("bbbbbbbbbbbb.0", [1, 0], True),
                   20: ("aaaaaaaaaaaa.1", [0, 1], False)}, got
    assert cli.main(["ls", persist.root]) == 0
    out = capsys.readouterr().out
    assert "newest save (*): step 11, save bbbbbbbbbbbb.0" in out, out
    assert "1 committed copies of higher steps belong to older saves" in out and "steps [20]" in out, out


def test_ls_marks_abandoned_saves_whatever_their_marker(tmp_path, capsys):
    """The rollback's step 11 records that its run resumed 10: the still committed 20 (a rename
    that failed) is an abandoned save, marked as such and never the newest — also once 11 is gone
    from this root's view of the newest (only its manifest proves it)."""
    nvme = Store(str(tmp_path / "job" / "nvme" / "node-1"))
    persist = Store(str(tmp_path / "job" / "pfs"))
    b = {"save_id": "aaaaaaaaaaaa.0", "save_order": [0, 0], "step": 10, "since": [1, 0]}
    for store, rel, tier in ((persist, persistent_step, "persistent"), (nvme, local_step, "local")):
        write_step(store, rel(10), dcp_files(1), tier=tier, step=10, save_id="aaaaaaaaaaaa.0", save_order=[0, 0],
                   descends_from=None)
        write_step(store, rel(20), dcp_files(2), tier=tier, step=20, save_id="aaaaaaaaaaaa.1", save_order=[0, 1])
    write_step(persist, persistent_step(11), dcp_files(3), tier="persistent", step=11, save_id="bbbbbbbbbbbb.0",
               save_order=[1, 0], descends_from=b)
    rc, rows = run_json(capsys, "ls", str(tmp_path / "job"))
    assert rc == 0
    got = sorted((r["tier"], r["step"], r["abandoned"], r["newest"]) for r in rows)
    assert got == [("local", 10, None, False), ("local", 20, "bbbbbbbbbbbb.0", False),
                   ("persistent", 10, None, False), ("persistent", 11, None, True),
                   ("persistent", 20, "bbbbbbbbbbbb.0", False)], got
    assert cli.main(["ls", str(tmp_path / "job")]) == 0
    out = capsys.readouterr().out
    assert "yes, abandoned" in out and "newest save (*): step 11" in out, out
    assert "2 committed copies belong to abandoned saves" in out and "aaaaaaaaaaaa.1 (abandoned by bbbbbbbbbbbb.0)" in out
    assert "belong to older saves" not in out, out  # 20 is abandoned, not merely an older save
    # a root that does not hold the proving save (one node's disk): today's view, 20 not marked
    rc, rows = run_json(capsys, "ls", nvme.root)
    assert {r["step"]: r["abandoned"] for r in rows} == {10: None, 20: None}


# -- verify ------------------------------------------------------------------------------------
def test_verify_intact_tree_passes_and_ignores_uncommitted(tree, capsys):
    assert cli.main(["verify", str(tree["job"])]) == 0
    out = capsys.readouterr().out
    assert "4 steps verified, 0 corrupt, 1 uncommitted" in out
    assert "uncommitted (ignored by restore)" in out
    rc, doc = run_json(capsys, "verify", str(tree["job"]))
    assert rc == 0
    assert (doc["verified"], doc["corrupt"], doc["uncommitted"]) == (4, 0, 1)


def test_verify_detects_bit_flip(tree, capsys):
    victim = Path(tree["n1"].path(local_step(10))) / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[1234] ^= 0x01
    victim.write_bytes(bytes(data))
    assert cli.main(["verify", str(tree["job"])]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "4 steps verified, 1 corrupt, 1 uncommitted" in out
    rc, doc = run_json(capsys, "verify", str(tree["job"]))
    assert rc == 1
    bad = [s for s in doc["steps"] if s["status"] == "CORRUPT"]
    assert [(s["tier"], s["node"]) for s in bad] == [("local", 1)]
    assert "xxh3_64" in bad[0]["problems"][0] and "__0_0.distcp" in bad[0]["problems"][0]


def test_verify_detects_truncation(tree, capsys):
    victim = Path(tree["persist"].path("step-10")) / "__1_0.distcp"
    with open(victim, "r+b") as f:
        f.truncate(100)
    rc, doc = run_json(capsys, "verify", str(tree["job"]))
    assert rc == 1
    bad = [s for s in doc["steps"] if s["status"] == "CORRUPT"]
    assert [s["tier"] for s in bad] == ["persistent"]
    assert "size 100" in bad[0]["problems"][0]


def test_verify_detects_missing_file_in_replica(tree, capsys):
    os.remove(Path(tree["n0"].path(replica_step(1, 10))) / ".metadata")
    rc, doc = run_json(capsys, "verify", str(tree["job"]))
    assert rc == 1
    bad = [s for s in doc["steps"] if s["status"] == "CORRUPT"]
    assert [(s["tier"], s["node"], s["source_node"]) for s in bad] == [("replica", 0, 1)]
    assert "missing" in bad[0]["problems"][0]


def test_verify_marker_without_matching_manifest_is_corrupt(tree, capsys):
    mpath = Path(tree["persist"].path("step-10")) / MANIFEST
    mpath.write_bytes(mpath.read_bytes().replace(b'"total_bytes"', b'"total_bytez"'))
    rc, doc = run_json(capsys, "verify", str(tree["job"]))
    assert rc == 1
    bad = [s for s in doc["steps"] if s["status"] == "CORRUPT"]
    assert [s["tier"] for s in bad] == ["persistent"]
    assert "marker" in bad[0]["problems"][0]


def test_verify_single_step_dir_as_root(tree, capsys):
    rc, doc = run_json(capsys, "verify", tree["persist"].path("step-10"))
    assert rc == 0
    assert [(s["tier"], s["step"], s["status"]) for s in doc["steps"]] == [("persistent", 10, "OK")]
    rc, doc = run_json(capsys, "verify", tree["n0"].path(local_step(20)))
    assert rc == 0 and doc["uncommitted"] == 1 and doc["verified"] == 0


# -- ledger ------------------------------------------------------------------------------------
@pytest.fixture
def ledger_root(tmp_path: Path) -> Store:
    """A ledger with a failed run (no run_end), a clean run with a restore, and a torn tail."""
    store = Store(str(tmp_path / "persist"))
    a = Ledger(store, enabled=True, run_id="run-aaaaaaaaaaaaaaaa", job="j1")
    a.append(RunStartRecord(world_size=8, nodes=2, ranks_per_node=4, restart_count=0, host="h0"))
    a.append(CheckpointRecord(tier="local", step=10, blocking_s=0.5, background_s=2.0, bytes=3 << 30, ok=True))
    a.append(CheckpointRecord(tier="persistent", step=10, blocking_s=0.0, background_s=0.0, bytes=0,
                              ok=False, error="disk full"))
    # run a dies here: no run_end
    b = Ledger(store, enabled=True, run_id="run-bbbbbbbbbbbbbbbb", job="j1")
    b.append(RunStartRecord(world_size=8, nodes=2, ranks_per_node=4, restart_count=1, host="h0"))
    b.append(RestoreRecord(step=10, sources={"0": {"source": "own-local", "holder": 0},
                                             "1": {"source": "peer-replica", "holder": 0}},
                           bytes=6 << 30, seconds=4.2, attempts=1, persistent_bytes=0))
    b.append(CheckpointRecord(tier="local", step=20, blocking_s=1.5, background_s=3.0, bytes=2 << 30, ok=True))
    b.append(RunEndRecord(clean=True, exposure_s=123.0, reason="finished"))
    with open(store.path(LEDGER), "ab") as f:
        f.write(b'{"kind": "checkpoint", "time": 1.0, "run_id": "run-cc')  # writer died mid-line
    return store


def test_ledger_summary_tables(ledger_root, capsys):
    assert cli.main(["ledger", ledger_root.root]) == 0
    out = capsys.readouterr().out
    assert "runs: 2, failures (no clean end): 1" in out
    assert "no clean end" in out and "clean" in out
    assert "node 0: own-local@0" in out and "node 1: peer-replica@0" in out
    assert "2.0 GiB" in out  # last local checkpoint
    assert "1.000" in out  # mean local blocking s: (0.5 + 1.5) / 2


def test_ledger_json_counts_failure(ledger_root, capsys):
    rc, summary = run_json(capsys, "ledger", ledger_root.root)
    assert rc == 0
    assert [r["run_id"] for r in summary["runs"]] == ["run-aaaaaaaaaaaaaaaa", "run-bbbbbbbbbbbbbbbb"]
    assert [r["run_id"] for r in summary["failures"]] == ["run-aaaaaaaaaaaaaaaa"]
    assert summary["runs"][1]["clean"] is True and summary["runs"][1]["restart_count"] == 1
    local = summary["checkpoints"]["local"]
    assert (local["count"], local["ok"], local["failed"], local["last_step"]) == (2, 2, 0, 20)
    assert summary["checkpoints"]["persistent"]["failed"] == 1
    assert len(summary["restores"]) == 1 and summary["restores"][0]["step"] == 10


def _recovery_ledger(tmp_path: Path) -> Store:
    store = Store(str(tmp_path / "rec"))
    led = Ledger(store, enabled=True, run_id="run-r", job="j1")
    led.append(RunStartRecord(world_size=2, nodes=2, ranks_per_node=1, restart_count=1, host="h0"))
    secs = [0.0, 0.25, 0.5, 1.5, 9.5, 10.0, 11.0, 11.5, 14.25]
    led.append(RecoveryRecord(step=6, cause="node-failure", attempt=1, restart_count=1, failed_nodes=[1], warm=False,
                              replaced={"1": "spare slot 3"}, origin="failure_noticed",
                              phases={p: 1.7e9 + x for p, x in zip(RECOVERY_PHASES, secs)},
                              phases_s=dict(zip(RECOVERY_PHASES, secs)), total_s=14.25,
                              nodes={"0": {"source": "own-local", "holder": 0, "bytes": 3 << 20,
                                           "processes_started_s": 1.2, "imports_done_s": 9.1},
                                     "1": {"source": "peer-replica", "holder": 0, "bytes": 3 << 20,
                                           "processes_started_s": 1.5, "imports_done_s": 9.5}},
                              notes=["processes_started was 0.004 s before launched (clock skew): clamped"]))
    led.append(RecoveryRecord(step=9, cause="restart", origin="processes_started",
                              phases_s={"processes_started": 0.0, "imports_done": 8.0, "first_step_done": 12.0}))
    return store


def test_ledger_shows_each_recovery_phase(tmp_path, capsys):
    store = _recovery_ledger(tmp_path)
    assert cli.main(["ledger", store.root]) == 0
    out = capsys.readouterr().out
    assert "recovery: step 6, node-failure, attempt 1, failed nodes [1]" in out
    first = out[out.index("recovery: step 6"):out.index("recovery: step 9")]
    lines = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:4]]
             for ln in first.splitlines() if ln.count("│") >= 4}
    assert list(lines) == [p.replace("_", " ") for p in RECOVERY_PHASES]
    assert lines["failure noticed"] == ["0.00", "-"]
    assert lines["survivors stopped"] == ["0.25", "0.25"]
    assert lines["imports done"] == ["9.50", "8.00"]
    assert "s since failure noticed" in out and "s since process start" in out
    assert "total (failure noticed → first step): 14.25 s, cold processes" in out.replace("\n", " ")
    assert "node 1: peer-replica@0, 3.0 MiB, started 1.50 s, imports 9.50 s" in out
    assert "node 1 replaced by spare slot 3" in out and "note: processes_started was 0.004 s" in out
    # the manual restart: no launcher phases, counted from the process start
    assert "step 9, restart" in out and "total (failure noticed → first step): - s" in out
    assert out.index("step 6, node-failure") < out.index("step 9, restart")


def test_ledger_json_lists_recoveries(tmp_path, capsys):
    rc, summary = run_json(capsys, "ledger", _recovery_ledger(tmp_path).root)
    assert rc == 0 and [r["step"] for r in summary["recoveries"]] == [6, 9]
    assert summary["recoveries"][0]["phases_s"]["first_step_done"] == 14.25
    assert summary["recoveries"][0]["kind"] == "recovery" and summary["recoveries"][1]["total_s"] is None


def test_ledger_append_after_torn_line_stays_parseable(ledger_root, capsys):
    before = Ledger.read(ledger_root)
    c = Ledger(ledger_root, enabled=True, run_id="run-c", job="j1")
    rec = c.append(RunStartRecord(world_size=8, nodes=2, ranks_per_node=4, restart_count=2, host="h1"))
    after = Ledger.read(ledger_root)
    assert len(after) == len(before) + 1
    assert after[-1] == json.loads(json.dumps(rec))
    raw = Path(ledger_root.path(LEDGER)).read_bytes()
    assert raw.endswith(b"\n")
    assert raw.splitlines()[-2].startswith(b'{"kind": "checkpoint", "time": 1.0')  # torn line kept apart
    rc, summary = run_json(capsys, "ledger", ledger_root.root)
    assert rc == 0
    assert len(summary["runs"]) == 3
    # run-c has started and not ended: it counts as no clean end (it may still be running)
    assert [r["run_id"] for r in summary["failures"]] == ["run-aaaaaaaaaaaaaaaa", "run-c"]


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["ls", "verify", "ledger"])
def test_nonexistent_root_exits_2(tmp_path, capsys, command):
    missing = str(tmp_path / "nope")
    assert cli.main([command, missing]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and missing in err


def test_root_is_a_file_exits_2(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert cli.main(["ls", str(f)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_ledger_missing_file_exits_2(tmp_path, capsys):
    assert cli.main(["ledger", str(tmp_path)]) == 2
    assert "no ledger" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["--help"]) == 0
    assert "ledger" in capsys.readouterr().out


def test_register_command_adds_subcommand(capsys):
    def register(subparsers):
        p = subparsers.add_parser("hello")
        p.set_defaults(func=lambda args: print("hi") or 0)

    cli.register_command(register)
    try:
        assert cli.main(["hello"]) == 0
        assert capsys.readouterr().out.strip() == "hi"
    finally:
        cli.REGISTRARS.remove(register)


def test_human_bytes():
    assert cli.human_bytes(None) == "-"
    assert cli.human_bytes(0) == "0 B"
    assert cli.human_bytes(1023) == "1023 B"
    assert cli.human_bytes(1536) == "1.5 KiB"
    assert cli.human_bytes(int(1.2 * (1 << 30))) == "1.2 GiB"
    assert cli.human_bytes(5 << 50) == "5.0 PiB"


# -- the installed console script --------------------------------------------------------------
def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "tierckpt"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tierckpt.cli"]


def test_console_script_subprocess(tree):
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([*_console_script(), "ls", str(tree["job"]), "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)) == 5
    victim = Path(tree["persist"].path("step-10")) / ".metadata"
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    p = subprocess.run([sys.executable, "-m", "tierckpt.cli", "verify", str(tree["job"])], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "4 steps verified, 1 corrupt, 1 uncommitted" in p.stdout
    p = subprocess.run([*_console_script(), "ls", str(tree["job"] / "missing")], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "does not exist" in p.stderr and p.stdout == ""



def test_verify_of_a_root_without_steps_fails(tmp_path):
    (tmp_path / "empty").mkdir()
    assert cli.main(["verify", str(tmp_path / "empty")]) == 2
