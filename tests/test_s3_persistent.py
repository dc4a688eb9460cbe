"""The persistent tier on a real S3-API server: moto's server mode on the loopback
(tests/s3_server.py, the session fixture ``s3_server``), reached through s3fs as a user would.

Two simulated nodes (one rank each, F = 2) save every tier to ``s3://<bucket>/run``; the tests
restore from the bucket after the node-local roots are wiped, corrupt one object (a fallback to
the older step), deny writes with a bucket policy (TierFailedError naming the URL, then the job
goes on), start on a missing bucket (a ConfigError naming the URL; no bucket created), check
lineage and retention there, run ``tierckpt ls/verify/ledger`` on the URL, train through the
torchtitan front end with ``persistent_folder = "s3://..."``, and check that a ledger append on an
object store writes one object of the record's size, however long the ledger is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import ROOT, TITAN_TEST_ARGS, TITAN_TOML, free_port, run_world
from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.io import layout
from tierckpt.io.storage import Store


def _opts(server) -> dict:
    """``TierConfig.storage_options`` reaching ``server``, in the per-URL-prefix form."""
    return {"s3://": server.options()}


@pytest.fixture(scope="module")
def saved(s3_server, tmp_path_factory):
    """One run on a fresh bucket, endpoint and keys given as storage_options: steps 1, 2, 3
    saved to every tier with the persistent tier keeping 2."""
    bucket = s3_server.new_bucket()
    url, base = f"s3://{bucket}/run", str(tmp_path_factory.mktemp("s3run"))
    cfg_kw = {"storage_options": _opts(s3_server), "keep_latest_k": {"persistent": 2}}
    res = run_world(_scn().phase_save, 2, url, base, [1, 2, 3], cfg_kw, env={"AWS_DEFAULT_REGION": "us-east-1"})
    return {"bucket": bucket, "url": url, "base": base, "cfg_kw": cfg_kw, "res": [r.value for r in res]}


def _scn():
    from tests import scenarios_s3

    return scenarios_s3


def test_every_tier_saves_and_retention_keeps_k_on_s3(saved, s3_server):
    for r in saved["res"]:
        assert all(ok for recs in r["records"].values() for ok, _ in recs.values()), r["records"]
    # keep_latest_k persistent = 2: global rank 0's retention removed step 1 from the bucket
    assert saved["res"][0]["committed"] == [2, 3]
    keys = s3_server.keys(saved["bucket"], "run/")
    steps = {k.split("/")[1] for k in keys if k.split("/")[1].startswith("step-")}
    assert steps == {"step-2", "step-3"}, sorted(keys)
    assert {f"run/step-{s}/{layout.MARKER}" for s in (2, 3)} <= set(keys)
    # the local tier and its replicas are on the node-local roots, not in the bucket
    for node in (0, 1):
        nvme = os.path.join(saved["base"], "nvme", f"node-{node}")
        assert os.path.exists(os.path.join(nvme, "local", "step-3", layout.MARKER))
        assert os.path.exists(os.path.join(nvme, "replicas", f"node-{1 - node}", "step-3", layout.MARKER))


def test_lineage_recorded_in_the_bucket(saved, s3_server):
    store = Store(saved["url"], **s3_server.options())
    lid = json.loads(store.read_bytes(layout.LINEAGE))["lineage"]
    assert {r["lineage"] for r in saved["res"]} == {lid}
    for s in (2, 3):
        assert json.loads(store.read_bytes(f"step-{s}/{layout.MANIFEST}"))["lineage"] == lid


def test_restore_from_s3_after_local_roots_are_wiped(saved):
    res = run_world(_scn().phase_restore, 2, saved["url"], saved["base"], True, saved["cfg_kw"],
                    env={"AWS_DEFAULT_REGION": "us-east-1"})
    for r in res:
        assert (r.value["step"], r.value["kinds"], r.value["equal"]) == (3, ["persistent"], True), r.value
    assert res[0].value["persistent_bytes"] > 0


def test_cli_ls_verify_ledger_on_the_url(saved, s3_server, monkeypatch, capsys):
    from tierckpt.cli import main

    for k, v in s3_server.env().items():  # endpoint and keys from the environment, as s3fs users set them
        monkeypatch.setenv(k, v)
    assert main(["ls", saved["url"], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    rows = rows["steps"] if isinstance(rows, dict) else rows
    assert sorted((r["tier"], r["step"], r["committed"]) for r in rows) == [("persistent", 2, True),
                                                                            ("persistent", 3, True)]
    assert main(["verify", saved["url"]]) == 0
    capsys.readouterr()
    assert main(["ledger", saved["url"], "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["checkpoints"]["persistent"]["ok"] == 3 and summary["checkpoints"]["persistent"]["last_step"] == 3
    assert len(summary["runs"]) >= 1 and summary["runs"][0]["clean"] is True
    # the same with the options on the command line instead of the environment
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert main(["verify", saved["url"], "--storage-options", json.dumps(s3_server.options())]) == 0
    assert main(["ls", saved["url"], "--storage-options", "[1]"]) == 2  # not a JSON object: usage error
    capsys.readouterr()


def test_corrupt_object_falls_back_to_the_older_step(saved, s3_server, capsys):
    from tierckpt.cli import main

    client, bucket = s3_server.client(), saved["bucket"]
    data_key = next(k for k in sorted(s3_server.keys(bucket, "run/step-3/")) if k.endswith(".distcp"))
    original = client.get_object(Bucket=bucket, Key=data_key)["Body"].read()
    client.put_object(Bucket=bucket, Key=data_key, Body=bytes(b ^ 0xFF for b in original))  # same size
    try:
        assert main(["verify", saved["url"], "--storage-options", json.dumps(s3_server.options())]) == 1
        capsys.readouterr()
        res = run_world(_scn().phase_restore, 2, saved["url"], saved["base"], True, saved["cfg_kw"],
                        env={"AWS_DEFAULT_REGION": "us-east-1"})
        for r in res:
            assert (r.value["step"], r.value["kinds"], r.value["equal"]) == (2, ["persistent"], False), r.value
            assert any(kind == "persistent" and step == 3 for kind, step, _ in r.value["failures"]), r.value
    finally:
        client.put_object(Bucket=bucket, Key=data_key, Body=original)


@pytest.mark.parametrize("fault, words", [("deny", "access denied"), ("full", "out of space or over its quota")])
def test_refused_writes_fail_with_a_clear_error_and_the_job_goes_on(s3_server, tmp_path, capsys, fault, words):
    """A bucket policy denying PutObject, and a bucket that runs out of space part-way through
    a save (HTTP 507 XMinioStorageFull): the failed step's TierFailedError names the URL and
    the cause, training goes on on the local tier, no committed step is lost or changed, and
    the job commits to the bucket again once it takes writes."""
    from tierckpt.cli import main

    bucket = s3_server.new_bucket()
    url, base = f"s3://{bucket}/run", str(tmp_path)
    res = run_world(_scn().phase_write_refused, 2, url, base, bucket, s3_server.endpoint, fault, env=s3_server.env())
    for r in res:
        out = r.value
        assert out["s1"] == {"local": True, "persistent": True}
        assert out["s2"]["local"][0] is True  # the local tier does not depend on the bucket
        ok, error = out["s2"]["persistent"]
        assert ok is False and words in error and url in error, error
        tier, step, msg = out["raised"]
        assert (tier, step) == ("persistent", 2) and url in msg and words in msg, msg
        assert out["s3"] == {"local": True, "persistent": True}
        assert out["committed"] == [1, 3]
    if fault == "full":
        assert "XMinioStorageFull" in res[0].value["s2"]["persistent"][1]
    # step 1's objects untouched, step 2 never committed, every committed step verifies
    assert res[0].value["etags_after"] == res[0].value["etags_before"] != {}
    assert f"run/step-2/{layout.MARKER}" not in s3_server.keys(bucket, "run/")
    assert main(["verify", url, "--storage-options", json.dumps(s3_server.options())]) == 0
    capsys.readouterr()
    if fault == "full":  # and the newest one restores from the bucket alone, bit for bit
        rest = run_world(_scn().phase_restore, 2, url, base, True, {}, env=s3_server.env())
        for r in rest:
            assert (r.value["step"], r.value["kinds"], r.value["equal"]) == (3, ["persistent"], True), r.value


def test_missing_bucket_is_a_config_error_naming_the_url(s3_server, tmp_path):
    url = "s3://tck-no-such-bucket/run"
    res = run_world(_scn().phase_start, 1, url, str(tmp_path), env=s3_server.env())
    option, msg = res[0].value
    assert option == "persistent_root" and url in msg and "does not exist" in msg and "never creates" in msg
    names = [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    assert "tck-no-such-bucket" not in names  # not created by the start


def test_access_denied_at_start_is_a_config_error_naming_the_url(tmp_path):
    """Credentials the server does not accept (moto with IAM authentication on refuses even
    HeadBucket, as AWS refuses wrong or expired keys): the start stops with a ConfigError
    naming persistent_root, the URL and what to check."""
    from tests.s3_server import S3Server, ServerUnavailable

    server = S3Server(auth=True)
    try:
        server.start()
    except ServerUnavailable as e:
        pytest.skip(f"no S3-API server with authentication: {e}")
    try:
        bucket = server.new_bucket()  # the one request before authentication is on
        url = f"s3://{bucket}/run"
        res = run_world(_scn().phase_start, 1, url, str(tmp_path), env=server.env())
        option, msg = res[0].value
        assert option == "persistent_root" and url in msg and "denied" in msg and "credentials" in msg, msg
        assert server.stats(bucket)["requests"].get("HEAD bucket", 0) >= 1  # refused at the bucket check
    finally:
        server.stop()


def test_ledger_append_costs_one_object_of_the_record(s3_server, caplog):
    """What each of 60 appends sends the server (counted by the server, tests/s3_server.py
    Meter): one PUT of the record's bytes, no read, the 60th as small as the 1st (a ledger
    rewritten whole would send 60 times the bytes, a read-modify-write a GET); then the tolerant
    reader on the bucket: append order across two writers, a torn and a garbage object skipped."""
    from tierckpt.history.ledger import Ledger
    from tierckpt.records import RunStartRecord

    bucket = s3_server.new_bucket()
    store = Store(f"s3://{bucket}/run", **s3_server.options())
    led = Ledger(store, enabled=True, run_id="r1", job="j")
    sent: list[tuple[int, dict]] = []  # per append: bytes PUT, {request kind: count}
    for i in range(60):
        before = s3_server.stats(bucket)
        led.append(RunStartRecord(restart_count=i % 10))
        after = s3_server.stats(bucket)
        kinds = {k: n - before["requests"].get(k, 0) for k, n in after["requests"].items()}
        sent.append((after["put_bytes"] - before["put_bytes"], {k: n for k, n in kinds.items() if n}))
    # the first append lists the ledger's prefix (for the next sequence number); none reads an object
    assert set(sent[0][1]) == {"GET bucket", "PUT object"} and sent[0][1]["PUT object"] == 1, sent[0]
    assert all(k == {"PUT object": 1} for _, k in sent[1:]), sent
    nbytes = [b for b, _ in sent]
    assert 0 < max(nbytes) < 400 and max(nbytes[-10:]) <= max(nbytes[:10]), nbytes
    keys = s3_server.keys(bucket, f"run/{layout.LEDGER_DIR}/")
    assert len(keys) == 60 and sum(keys.values()) == sum(nbytes) and not s3_server.keys(bucket, f"run/{layout.LEDGER}")
    # a torn record in the middle of the sequence, garbage at its end, a stray name: all skipped
    client, d = s3_server.client(), f"run/{layout.LEDGER_DIR}"
    client.put_object(Bucket=bucket, Key=f"{d}/000000000030-x-torn.json", Body=b'{"kind": "run_start", "ti')
    client.put_object(Bucket=bucket, Key=f"{d}/000000000060-x-junk.json", Body=bytes(range(256)))
    client.put_object(Bucket=bucket, Key=f"{d}/notes.txt", Body=b'{"kind": "not a record"}')
    # a second writer (the next run) continues the sequence after the highest it finds
    Ledger(store, enabled=True, run_id="r2", job="j").append(RunStartRecord(restart_count=99))
    assert f"{d}/000000000061-" in " ".join(s3_server.keys(bucket, d))
    with caplog.at_level("WARNING", logger="tierckpt.history.ledger"):
        recs = Ledger.read(store)
    assert [r["restart_count"] for r in recs] == [i % 10 for i in range(60)] + [99]
    assert [r["run_id"] for r in recs[-2:]] == ["r1", "r2"]
    assert sum("unparseable record object" in m for m in caplog.messages) == 2, caplog.messages


def test_explain_names_the_url_and_the_cause_of_a_refused_write():
    """objstore.explain on a remote root: access denied before out of space; out of space from
    an errno, a botocore-like response (code or HTTP 507), or only the text s3fs leaves after
    the error crossed ranks pickled; otherwise just the URL; nothing on a local path."""
    import errno
    import pickle

    from tierckpt.io import objstore

    store = Store("memory://tck-explain/run")

    class Answer(Exception):  # what botocore's ClientError carries
        def __init__(self, code, status):
            super().__init__(f"An error occurred ({code}) when calling the PutObject operation: no")
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    def wrapped(cause):  # s3fs's OSError with the ClientError as its cause
        e = OSError(errno.EIO, str(cause))
        e.__cause__ = cause
        return e

    class DCP(Exception):  # DCP's CheckpointException: {rank: (exception, frames)}
        def __init__(self, failures):
            super().__init__("ckpt")
            self.failures = failures

    full = " [memory://tck-explain/run: the object store is out of space or over its quota ({}): "
    for e, code in ((OSError(errno.ENOSPC, "No space left on device"), "ENOSPC"),
                    (wrapped(Answer("QuotaExceeded", 403)), "QuotaExceeded"),
                    (wrapped(Answer("SomethingNew", 507)), "SomethingNew"),
                    (DCP({1: (pickle.loads(pickle.dumps(wrapped(Answer("XMinioStorageFull", 507)))), [])}),
                     "XMinioStorageFull")):
        assert objstore.explain(e, store).startswith(full.format(code)), (e, objstore.explain(e, store))
    denied = DCP({0: (wrapped(Answer("XMinioStorageFull", 507)), []), 1: (PermissionError("Forbidden"), [])})
    assert objstore.explain(denied, store).startswith(" [memory://tck-explain/run: access denied: check the")
    assert objstore.explain(wrapped(Answer("InternalError", 500)), store) == " [memory://tck-explain/run]"
    assert objstore.explain(OSError(errno.ENOSPC, "full"), Store("/tmp")) == ""


def test_a_server_that_cannot_start_is_reported_with_its_stderr(monkeypatch):
    """The reason the fixture's skip gives: the child's exit code and the end of its stderr."""
    from tests import s3_server as mod

    pytest.importorskip("moto.server", reason="moto[server] not installed (requirements-dev.txt)")
    pytest.importorskip("s3fs", reason="s3fs not installed (requirements-dev.txt)")
    monkeypatch.setattr(mod, "__file__", os.path.join(ROOT, "tests", "no-such-server.py"))
    with pytest.raises(mod.ServerUnavailable) as e:
        mod.S3Server(start_timeout_s=30).start()
    assert "exited with code 2" in str(e.value) and "no-such-server.py" in str(e.value), e.value


def test_storage_options_config_flags_and_toml():
    cfg = TierConfig(persistent_root="s3://b/run", tiers=("persistent",),
                     storage_options={"anon": False, "s3://b/": {"endpoint_url": "http://x"}, "s3://": {"key": "k"}})
    assert cfg.options_for("s3://b/run") == {"anon": False, "endpoint_url": "http://x"}  # the longest prefix
    assert cfg.options_for("s3://c/run") == {"anon": False, "key": "k"}
    hash(cfg)  # nested mappings are frozen
    for bad, option in ((5, "storage_options"), ({"s3://b/": 3}, "storage_options.s3://b/")):
        with pytest.raises(ConfigError) as e:
            TierConfig(persistent_root="s3://b/run", tiers=("persistent",), storage_options=bad)
        assert e.value.option == option
    # Megatron's flag, parsed as a JSON object into the TierConfig
    import argparse

    from mcore_plugin.args import add_plugin_args

    p = add_plugin_args(argparse.ArgumentParser())
    assert p.parse_args(["--ckpt-plugin-storage-options", '{"endpoint_url": "http://x"}']).ckpt_plugin_storage_options \
        == {"endpoint_url": "http://x"}
    for text in ("not json", "[1]"):  # not JSON, not an object: usage errors
        with pytest.raises(SystemExit):
            p.parse_args(["--ckpt-plugin-storage-options", text])
    # set without the parser (Megatron's args_defaults, a script): the flag is named
    from mcore_plugin.args import tier_config_from_args, validate_plugin_args
    from tests.mcore.test_args import GOOD, parse

    args = parse([*GOOD, "--ckpt-plugin-storage-options", '{"s3://b/": {"endpoint_url": "http://x"}}'])
    validate_plugin_args(args)
    assert tier_config_from_args(args).options_for("s3://b/run") == {"endpoint_url": "http://x"}
    args.ckpt_plugin_storage_options = "nope"
    with pytest.raises(ConfigError) as e:
        validate_plugin_args(args)
    assert e.value.option == "--ckpt-plugin-storage-options", e.value
    # torchtitan's [checkpoint.storage_options] table, and a key added on the command line
    from titan_plugin.manager import TieredCheckpointManager
    from titan_plugin.toml import apply_table

    ck = TieredCheckpointManager.Config()
    apply_table(ck, {"storage_options": {"endpoint_url": "http://x"}}, "checkpoint.")
    apply_table(ck, {"storage_options": {"profile": "p"}}, "checkpoint.", from_cli=True)
    assert ck.storage_options == {"endpoint_url": "http://x", "profile": "p"}
    with pytest.raises(ConfigError) as e:
        apply_table(ck, {"storage_options": "nope"}, "checkpoint.", from_cli=True)
    assert e.value.option == "checkpoint.storage_options"


def test_titan_front_end_with_an_s3_persistent_folder(s3_server, tmp_path):
    """torchtitan's trainer with ``persistent_folder = "s3://..."``: a run saves to the bucket
    (endpoint from the environment), a second run on fresh nodes resumes from the bucket alone
    (endpoint from ``[checkpoint.storage_options]``). One process, started as torchrun's worker
    would be (its environment) without torchrun: the launcher costs seconds and is not what is
    tested here (tests/test_titan_*.py run torchrun)."""
    bucket = s3_server.new_bucket()
    url, tmp = f"s3://{bucket}/run", str(tmp_path)

    def train(steps, *extra, env_endpoint=True):
        cmd = [sys.executable, "-m", "titan_plugin.train", "--toml", TITAN_TOML, *TITAN_TEST_ARGS,
               "--dump_folder", os.path.join(tmp, "run"),
               "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"), "--training.steps", str(steps),
               "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "2",
               "--checkpoint.interval", "2", "--checkpoint.replication_factor", "1",
               "--checkpoint.persistent_folder", url, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", **s3_server.env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if not env_endpoint:
            del env["AWS_ENDPOINT_URL"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]

    train(2)  # endpoint and keys from the environment
    assert f"run/step-2/{layout.MARKER}" in s3_server.keys(bucket, "run/")
    shutil.rmtree(os.path.join(tmp, "nvme"))  # fresh nodes: only the bucket is left
    # the endpoint from [checkpoint.storage_options] (here on the command line) instead
    train(3, "--checkpoint.storage_options", json.dumps({"endpoint_url": s3_server.endpoint}), env_endpoint=False)
    keys = s3_server.keys(bucket, "run/")
    assert f"run/step-3/{layout.MARKER}" in keys  # the last step is durable
    from tierckpt.history.ledger import Ledger

    restores = [r for r in Ledger.read(Store(url, **s3_server.options())) if r["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 2, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"persistent"}

