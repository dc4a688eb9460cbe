"""torchtitan workflows of the resume-point contract (README "Resume-point contract"), each
through ``python -m titan_plugin.train`` on 2 ranks = 2 simulated nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, steps, *extra, check=True, persistent=None):
    from tests.harness import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "titan_plugin.train", "--toml", os.path.join(ROOT, "configs", "titan_demo.toml"),
           "--dump_folder", os.path.join(tmp, "run"), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.local_interval", "3", "--checkpoint.interval", "3", *extra]
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
    # the step-3 persistent save hit ENOSPC; the step-6 save of that tier raised it
    assert "the persistent tier's save of step 3 failed" in r.stderr and "No space left" in r.stderr, r.stderr[-4000:]
    ends = [x for x in _ledger(small_pfs) if x["kind"] == "run_end"]
    assert all(e["clean"] is False for e in ends), ends


def test_warn_only_persistent_failure_exits_zero_but_run_end_is_not_clean(tmp_path, small_pfs):
    r = _train(str(tmp_path), 4, "--checkpoint.warn_only_tiers", "local,persistent", persistent=small_pfs)
    out = r.stdout + r.stderr
    assert "persistent save of step 3 failed" in out and "No space left" in out, out[-4000:]
    ends = [x for x in _ledger(small_pfs) if x["kind"] == "run_end"]
    # the ledger shares the full disk: when its run_end could be written, it is not clean
    assert all(e["clean"] is False and e["durable_step"] is None for e in ends), ends
