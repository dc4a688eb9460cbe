"""Fixtures of the real Slurm tests: one private cluster (tests/slurm/cluster.py) per session.

Tests marked ``slurm`` run only when asked for (``make test-slurm`` sets TIERCKPT_SLURM_TESTS=1):
they install slurm-wlm + munge with apt-get (scripts/setup_slurm.sh, root) and run real
training jobs for about 8 minutes on 2 CPU cores. Otherwise they are skipped with
that reason. When asked for, they are skipped only if Slurm cannot be installed (the reason
says why).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.slurm.cluster import ClusterError, SlurmCluster, missing_tools

REPO = Path(__file__).resolve().parents[2]
NODES = ("n1", "n2", "n3")  # n1, n2 run 2-node jobs; n3 is the spare a failed node is swapped for


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TIERCKPT_SLURM_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="real Slurm cluster test (installs slurm-wlm+munge with apt-get as root, "
                                   "about 8 min of training jobs): run `make test-slurm`")
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(skip)


def _install() -> str | None:
    """Install Slurm if missing; returns why it cannot be used, or None."""
    if not missing_tools():
        return None
    if os.geteuid() != 0:
        return f"slurm-wlm/munge missing ({', '.join(missing_tools())}) and not root: cannot apt-get install"
    r = subprocess.run([str(REPO / "scripts" / "setup_slurm.sh")], capture_output=True, text=True)
    if r.returncode != 0 or missing_tools():
        return f"scripts/setup_slurm.sh could not install Slurm (exit {r.returncode}): {(r.stdout + r.stderr)[-800:]}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running private cluster with nodes n1, n2, n3 (cred_expire 10 s, RequeueExit=75)."""
    why = _install()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    cluster = SlurmCluster(str(root), nodes=NODES, cred_expire=10, requeue_exit=75)
    try:
        cluster.start()
    except ClusterError as e:
        pytest.fail(f"private Slurm cluster did not start: {e}")
    yield cluster
    started = dict(cluster.pids)
    cluster.stop()
    left = {name: pid for name, pid in started.items() if _running(pid, name.split("-")[0])}
    assert not left, f"daemons not stopped: {left}"


def _running(pid: int, program: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return f"({program})" in stat and stat.rsplit(")", 1)[1].split()[0] != "Z"
