"""torchtitan workflows of the resume-point contract (docs/resume-contract.md), each
through ``python -m titan_plugin.train`` on 2 ranks = 2 simulated nodes."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, steps, *extra, check=True, persistent=None):
    from tests.harness import titan_train_cmd

    cmd = [*titan_train_cmd(),
           "--dump_folder", os.path.join(tmp, "run"), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "3", "--checkpoint.interval", "3", *extra]
    if persistent:
        cmd += ["--checkpoint.persistent_folder", persistent]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _ledger(folder):
    path = os.path.join(folder, "tierckpt-ledger.jsonl")
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by the full disk
    return out


@pytest.fixture
def small_pfs(tmp_path):
    """A 40 MiB file system for the persistent tier: one persistent step of the demo needs ~72 MiB."""
    mnt = tmp_path / "pfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full shared file system is simulated with a 40 MiB tmpfs, and mounting one failed: {r.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_failed_persistent_save_fails_the_run_naming_tier_step_and_cause(tmp_path, small_pfs):
    r = _train(str(tmp_path), 6, check=False, persistent=small_pfs)
    assert r.returncode != 0, r.stderr[-3000:]
    # the step-3 persistent save hit ENOSPC; the step-6 save of that tier raised it, with the
    # cause as the writer reported it (torch's zip writer can turn ENOSPC into its own error, and
    # the "No space left" note depends on how much DCP cleaned up before it was taken)
    assert "the persistent tier's save of step 3 failed: " in r.stderr, r.stderr[-4000:]
    cause = r.stderr.split("the persistent tier's save of step 3 failed: ", 1)[1]
    assert cause.strip() and not cause.startswith("unknown error"), cause[:500]
    ends = [x for x in _ledger(small_pfs) if x["kind"] == "run_end"]
    assert all(e["clean"] is False for e in ends), ends


def test_warn_only_persistent_failure_exits_zero_but_run_end_is_not_clean(tmp_path, small_pfs):
    r = _train(str(tmp_path), 4, "--checkpoint.warn_only_tiers", "local,persistent", persistent=small_pfs)
    out = r.stdout + r.stderr
    assert "persistent save of step 3 failed: " in out, out[-4000:]
    ends = [x for x in _ledger(small_pfs) if x["kind"] == "run_end"]
    # the ledger shares the full disk: when its run_end could be written, it is not clean
    assert all(e["clean"] is False and e["durable_step"] is None for e in ends), ends


def _cmd(tmp, dump, steps, *extra):
    from tests.harness import titan_train_cmd

    return [*titan_train_cmd(),
            "--dump_folder", os.path.join(tmp, dump), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
            "--training.steps", str(steps), "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "3", "--checkpoint.interval", "6", *extra]


def _losses(dump) -> dict[int, str]:
    out = {}
    for line in open(os.path.join(dump, "metrics", "losses.jsonl")):
        r = json.loads(line)
        out[r["step"]] = r["loss_hex"]  # a resumed run appends: its own value wins
    return out


# `make test-long`: tests/test_preemption_signals.py::test_titan_loader_workers_sigterm_to_torchrun_saves_and_resumes_bitwise
# runs this workflow in `make test` (the same launches, with DataLoader workers) and asserts
# the same: both tiers committed at the agreed step, exit 75, a clean run_end at that step,
# the requeue restoring it from own-local, losses bitwise equal to an uninterrupted run's.
@pytest.mark.slow
def test_preemption_signal_saves_every_tier_and_the_requeue_resumes_there(tmp_path):
    """SIGTERM to torchrun (what Slurm sends before SIGKILL; torchrun forwards it to its
    workers) between two checkpoints: every rank saves at the same step, local + replica and
    persistent commit within the grace period, the workers exit 75; the requeued job resumes
    at that step with losses bitwise equal to an uninterrupted run's."""
    import signal
    import time

    tmp = str(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ref = subprocess.run(_cmd(tmp, "ref", 12, "--checkpoint.local_root", os.path.join(tmp, "refnvme", "node-{node}")),
                         cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt = os.path.join(tmp, "run", "checkpoint")
    log = open(os.path.join(tmp, "attempt1.log"), "w")
    p = subprocess.Popen(_cmd(tmp, "run", 12), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:  # past the first local checkpoint (step 3)
        try:
            done = [r for r in _ledger(ckpt) if r["kind"] == "checkpoint" and r["ok"] and r["tier"] == "local"]
        except OSError:
            done = []
        if done:
            break
        time.sleep(0.05)
    assert p.poll() is None, "training ended before the signal"
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    text = open(os.path.join(tmp, "attempt1.log")).read()
    assert rc != 0 and "exiting with status 75" in text, text[-3000:]
    pre = [r for r in _ledger(ckpt) if r["kind"] == "preemption"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGTERM", pre
    step = pre[0]["step"]
    assert 3 <= step < 12 and pre[0]["committed"] == {"local": True, "persistent": True}, pre
    ends = [r for r in _ledger(ckpt) if r["kind"] == "run_end"]
    assert ends[-1]["clean"] is True and ends[-1]["durable_step"] == step, ends
    _train_cmd(_cmd(tmp, "run", 12), env)
    restores = [x for x in _ledger(ckpt) if x["kind"] == "restore"]
    assert [x["step"] for x in restores] == [step], restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}, restores
    want, got = _losses(os.path.join(tmp, "ref")), _losses(os.path.join(tmp, "run"))
    assert sorted(got) == list(range(1, 13)), sorted(got)
    assert got == want, {s: (want[s], got[s]) for s in want if want[s] != got.get(s)}


def _train_cmd(cmd, env):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r
