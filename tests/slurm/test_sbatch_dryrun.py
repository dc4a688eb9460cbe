"""launch/*.sbatch without a cluster: shell syntax, and the command line each node would run
(TIERCKPT_DRY_RUN=1 prints it; a stand-in ``scontrol`` expands the node list). Runs in
``make test``; the real cluster tests are in test_slurm_launch.py.

mcore.sbatch is checked only this way here: a real Megatron-LM run needs a checkout
(MEGATRON_LM_DIR) and is the Megatron issue's test.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = [REPO / "launch" / n for n in ("titan.sbatch", "mcore.sbatch", "tierckpt_slurm.sh")]

SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo gpu01; echo gpu02; exit 0; fi
echo "fake scontrol: unexpected $*" >&2; exit 1
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _run(tmp_path, script: str, env: dict[str, str], args=()) -> subprocess.CompletedProcess:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text(SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    e = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "1234",
         "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path),
         "TIERCKPT_HOME": str(REPO), "TIERCKPT_PYTHON": sys.executable, "TIERCKPT_DRY_RUN": "1", **env}
    return subprocess.run(["bash", str(REPO / "launch" / script), *args], env=e, cwd=str(tmp_path),
                          capture_output=True, text=True)


def _node0(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("node 0: "))
    return shlex.split(line[len("node 0: "):])


def _torchrun(py: str, port: int, nproc: int = 1) -> list[str]:
    return [py, "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=0", f"--nproc-per-node={nproc}",
            "--master-addr=gpu01", f"--master-port={port}", "--max-restarts=0"]


PORT = 20000 + (1234 % 1500) * 8  # first attempt of job 1234


def test_mcore_command_line(tmp_path):
    meg = tmp_path / "Megatron-LM"
    meg.mkdir()
    (meg / "pretrain_gpt.py").write_text("")
    argsf = tmp_path / "gpt.args"
    argsf.write_text("# a GPT run\n--num-layers 2 --hidden-size 64   # tiny\n"
                     "--data-path 'my corpus/text_document'\n--ckpt-plugin-enable\n--save /old/save\n")
    r = _run(tmp_path, "mcore.sbatch", {"MEGATRON_LM_DIR": str(meg), "TIERCKPT_ARGS_FILE": str(argsf),
                                        "TIERCKPT_PERSISTENT_ROOT": "/lustre/ckpt", "TIERCKPT_NPROC_PER_NODE": "8"},
             ["--micro-batch-size", "2"])
    assert r.returncode == 0, r.stderr
    assert _node0(r.stdout) == _torchrun(sys.executable, PORT, 8) + [
        "-m", "mcore_plugin.pretrain", str(meg / "pretrain_gpt.py"),
        "--num-layers", "2", "--hidden-size", "64", "--data-path", "my corpus/text_document", "--ckpt-plugin-enable",
        "--save", "/old/save",
        "--ckpt-plugin-local-root", "/local_nvme/1234/node-{node}",
        "--save", "/lustre/ckpt", "--load", "/lustre/ckpt",
        "--micro-batch-size", "2"]
    srun = shlex.split(next(x for x in r.stdout.splitlines() if x.startswith("srun ")))
    assert srun[:5] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    # the restart counter lives in the state directory: the next attempt gets the next port
    assert (tmp_path / ".tierckpt" / "slurm-1234" / "attempts").read_text().strip() == "1"
    r2 = _run(tmp_path, "mcore.sbatch", {"MEGATRON_LM_DIR": str(meg), "TIERCKPT_ARGS_FILE": str(argsf)})
    assert f"--master-port={PORT + 1}" in _node0(r2.stdout)


def test_mcore_without_plugin_flag_and_errors(tmp_path):
    meg = tmp_path / "Megatron-LM"
    meg.mkdir()
    (meg / "pretrain_gpt.py").write_text("")
    argsf = tmp_path / "plain.args"
    argsf.write_text("--num-layers 2\n")
    r = _run(tmp_path, "mcore.sbatch", {"MEGATRON_LM_DIR": str(meg), "TIERCKPT_ARGS_FILE": str(argsf),
                                        "SLURM_TMPDIR": "/scratch/job"})
    assert r.returncode == 0, r.stderr
    assert "--ckpt-plugin-local-root" not in _node0(r.stdout)
    assert "no --ckpt-plugin-enable" in r.stderr
    r = _run(tmp_path, "mcore.sbatch", {"MEGATRON_LM_DIR": str(meg), "TIERCKPT_ARGS_FILE": str(argsf),
                                        "SLURM_TMPDIR": "/scratch/job"}, ["--ckpt-plugin-enable"])
    cmd = _node0(r.stdout)
    assert cmd[cmd.index("--ckpt-plugin-local-root") + 1] == "/scratch/job/tierckpt/node-{node}"
    r = _run(tmp_path, "mcore.sbatch", {"TIERCKPT_ARGS_FILE": str(argsf)})
    assert r.returncode == 2 and "MEGATRON_LM_DIR" in r.stderr
    r = _run(tmp_path, "mcore.sbatch", {"MEGATRON_LM_DIR": str(meg), "TIERCKPT_ARGS_FILE": str(tmp_path / "nope")})
    assert r.returncode == 2 and "TIERCKPT_ARGS_FILE" in r.stderr
    argsf.write_text("--data-path 'unterminated\n")
    r = _run(tmp_path, "mcore.sbatch", {"MEGATRON_LM_DIR": str(meg), "TIERCKPT_ARGS_FILE": str(argsf)})
    assert r.returncode == 2 and "cannot parse TIERCKPT_ARGS_FILE" in r.stderr, r.stderr


def test_titan_command_line(tmp_path):
    r = _run(tmp_path, "titan.sbatch", {"TIERCKPT_LOCAL_ROOT": "/nvme/run", "TIERCKPT_DUMP_FOLDER": "/lustre/run",
                                        "TIERCKPT_PERSISTENT_ROOT": "s3://bucket/run"}, ["--training.steps", "5"])
    assert r.returncode == 0, r.stderr
    assert _node0(r.stdout) == _torchrun(sys.executable, PORT) + [
        "-m", "titan_plugin.train", "--toml", str(REPO / "configs" / "titan_demo.toml"),
        "--checkpoint.local_root", "/nvme/run/node-{node}", "--dump_folder", "/lustre/run",
        "--checkpoint.persistent_folder", "s3://bucket/run", "--training.steps", "5"]


@pytest.mark.parametrize("var,value,needle", [
    ("TIERCKPT_REQUEUE", "sometimes", "allowed values: scontrol, exit, none"),
    ("TIERCKPT_MAX_ATTEMPTS", "0", "TIERCKPT_MAX_ATTEMPTS must be >= 1"),
    ("TIERCKPT_NPROC_PER_NODE", "eight", "TIERCKPT_NPROC_PER_NODE=eight: must be a non-negative integer"),
    ("TIERCKPT_TOML", "/nonexistent.toml", "TIERCKPT_TOML=/nonexistent.toml: no such file"),
])
def test_titan_bad_variables(tmp_path, var, value, needle):
    r = _run(tmp_path, "titan.sbatch", {var: value})
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_outside_slurm(tmp_path):
    r = _run(tmp_path, "titan.sbatch", {"SLURM_JOB_ID": ""})
    assert r.returncode == 2 and "inside a Slurm allocation" in r.stderr
