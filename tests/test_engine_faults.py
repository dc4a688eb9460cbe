"""Crash consistency, uneven shards, bad input and a full local disk."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests import scenarios
from tests.harness import run_world


def test_sigkill_mid_background_write_leaves_torn_step_invisible(tmp_path):
    base = str(tmp_path)
    res = run_world(scenarios.phase_killed_mid_write, 2, base, 1, allow_killed=True, timeout=120)
    assert res[1].exitcode == -signal.SIGKILL, res
    torn = os.path.join(base, "nvme", "node-1", "local", "step-4")
    assert os.path.isdir(torn) and os.listdir(torn), "the kill must leave a torn step behind"
    assert not os.path.exists(os.path.join(torn, "tierckpt.committed"))
    out = run_world(scenarios.phase_restore_and_check, 2, base, 1, 2, 0)[0].value
    assert out["step"] == 2, out
    assert all(src[0] == "own-local" for src in out["sources"].values()), out
