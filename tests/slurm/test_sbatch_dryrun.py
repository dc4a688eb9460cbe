"""launch/*.sbatch without a cluster: shell syntax, and the command line each node would run
(TIERCKPT_DRY_RUN=1 prints it; a stand-in ``scontrol`` expands the node list). Runs in
``make test``; the real cluster tests are in test_slurm_launch.py. The preemption logic runs with
stand-ins for srun, scancel and scontrol.

mcore.sbatch is checked only this way here: a real Megatron-LM run needs a checkout
(MEGATRON_LM_DIR) and is the Megatron issue's test.
"""

from __future__ import annotations

import os
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


def _torchrun(py: str, port: int, nproc: int = 1, shutdown: int = 90) -> list[str]:
    # --shutdown-timeout: torchrun's 30 s would SIGKILL the ranks inside a 25 s preemption save
    return [py, "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=0", f"--nproc-per-node={nproc}",
            "--master-addr=gpu01", f"--master-port={port}", "--max-restarts=0", f"--shutdown-timeout={shutdown}"]


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


def test_titan_warm_agents_command_line(tmp_path):
    """TIERCKPT_AGENTS=warm: the batch script runs launch/slurm_agents.py over every host of the
    allocation, the last TIERCKPT_SPARES of them spares, MIN_NODES counted without them."""
    r = _run(tmp_path, "titan.sbatch", {"TIERCKPT_LOCAL_ROOT": "/nvme/run", "TIERCKPT_AGENTS": "warm",
                                        "TIERCKPT_SPARES": "1", "TIERCKPT_HANG_TIMEOUT": "15"},
             ["--training.steps", "5"])
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip().splitlines()[-1])
    i = cmd.index("--")
    assert cmd[:2] == [sys.executable, str(REPO / "launch" / "slurm_agents.py")], cmd
    opts = dict(zip(cmd[2:i:2], cmd[3:i:2]))
    assert opts == {"--hosts": "gpu01,gpu02", "--spares": "1", "--state-dir": str(tmp_path / ".tierckpt" / "slurm-1234"),
                    "--nproc-per-node": "1", "--max-attempts": "3", "--min-nodes": "1",
                    "--local-root": "/nvme/run/node-{node}", "--hang-timeout": "15", "--notice-grace": "90"}, opts
    assert cmd[i + 1:] == ["-m", "titan_plugin.train", "--toml", str(REPO / "configs" / "titan_demo.toml"),
                           "--checkpoint.local_root", "/nvme/run/node-{node}", "--training.steps", "5"], cmd


def test_titan_shutdown_timeout_is_passed_to_torchrun(tmp_path):
    r = _run(tmp_path, "titan.sbatch", {"TIERCKPT_SHUTDOWN_TIMEOUT": "150"})
    assert r.returncode == 0, r.stderr
    assert _node0(r.stdout)[:10] == _torchrun(sys.executable, PORT, shutdown=150), r.stdout


@pytest.mark.parametrize("var,value,needle", [
    ("TIERCKPT_REQUEUE", "sometimes", "allowed values: scontrol, exit, none"),
    ("TIERCKPT_SHUTDOWN_TIMEOUT", "soon", "TIERCKPT_SHUTDOWN_TIMEOUT=soon: must be whole seconds >= 1"),
    ("TIERCKPT_SHUTDOWN_TIMEOUT", "0", "TIERCKPT_SHUTDOWN_TIMEOUT=0: must be whole seconds >= 1"),
    ("TIERCKPT_MAX_ATTEMPTS", "0", "TIERCKPT_MAX_ATTEMPTS must be >= 1"),
    ("TIERCKPT_NPROC_PER_NODE", "eight", "TIERCKPT_NPROC_PER_NODE=eight: must be a non-negative integer"),
    ("TIERCKPT_TOML", "/nonexistent.toml", "TIERCKPT_TOML=/nonexistent.toml: no such file"),
    ("TIERCKPT_MIN_NODES", "3", "TIERCKPT_MIN_NODES=3: must be an integer in 1..2 (the allocation's 2 nodes"),
    ("TIERCKPT_AGENTS", "hot", "TIERCKPT_AGENTS=hot: allowed values: torchrun"),
    ("TIERCKPT_SPARES", "2", "TIERCKPT_SPARES=2: must be an integer in 0..1"),
    ("TIERCKPT_SPARES", "1", "TIERCKPT_SPARES=1 needs TIERCKPT_AGENTS=warm"),
    ("TIERCKPT_HANG_TIMEOUT", "soon", "TIERCKPT_HANG_TIMEOUT=soon: must be seconds"),
])
def test_titan_bad_variables(tmp_path, var, value, needle):
    r = _run(tmp_path, "titan.sbatch", {var: value})
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_outside_slurm(tmp_path):
    r = _run(tmp_path, "titan.sbatch", {"SLURM_JOB_ID": ""})
    assert r.returncode == 2 and "inside a Slurm allocation" in r.stderr


# ------------------------------------------------- preemption, with stand-ins for srun and Slurm
# srun: one process group per node running the real node script (SLURM_NODEID 0..N-1), and, as
# --kill-on-bad-exit=1 does, SIGTERM to the other nodes once one exits non-zero. scancel: the
# signal to every node's process group (what Slurm does to a step's processes). scontrol: the
# host list, the job's state ($FAKE_JOBSTATE, default RUNNING) and a logged `requeue`.
FAKE_SRUN = r"""#!/bin/bash
while [ $# -gt 0 ] && [ "$1" != bash ]; do shift; done
shift 2; script=$1; shift 2
set -m
pids=()
for i in $(seq 0 $((TCK_NNODES - 1))); do
  SLURM_NODEID=$i SLURMD_NODENAME=gpu0$((i + 1)) bash -c "$script" tierckpt-node "$@" &
  pids+=($!); echo $! >> "$FAKE_DIR/groups"
done
rc=0
for _ in "${pids[@]}"; do
  wait -n; r=$?
  if [ "$r" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$r
    for p in "${pids[@]}"; do kill -TERM -- -"$p" 2>/dev/null; done
  fi
done
exit $rc
"""

FAKE_SCANCEL = r"""#!/bin/bash
echo "scancel $*" >> "$FAKE_DIR/calls"
sig=${1#--signal=}
for g in $(cat "$FAKE_DIR/groups"); do kill -"$sig" -- -"$g" 2>/dev/null; done
exit 0
"""

FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
case "$1 $2" in
  "show hostnames") echo gpu01; echo gpu02 ;;
  "show job") echo "JobId=1234 JobState=${FAKE_JOBSTATE:-RUNNING} ExcNodeList=(null)" ;;
  "requeue 1234") ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

# torchrun + its worker on one node ($FAKE_MODE): "exit75": the worker saved for a preemption
# and exited 75, torchrun reports it as the root cause; "crash": the worker raised (exit 1);
# "wait": train until SIGTERM (torchrun's SignalException: exit 1 after the worker's final save).
FAKE_TORCHRUN = r"""#!/bin/bash
rank=; for a in "$@"; do case "$a" in --node-rank=*) rank=${a#*=} ;; esac; done
echo "node $rank attempt $TIERCKPT_RESTART_COUNT" >> "$FAKE_DIR/nodes"
echo "$* | TIERCKPT_SHUTDOWN_TIMEOUT=${TIERCKPT_SHUTDOWN_TIMEOUT:-}" >> "$FAKE_DIR/args-$rank"
summary() { printf 'Root Cause (first observed failure):\n[0]:\n  exitcode  : %s (pid: 1)\n' "$1" >&2; }
case "$FAKE_MODE" in
  exit75) sleep 0.3; echo "titan_plugin.train: SIGUSR1 received: step 4 saved" >&2; summary 75; exit 1 ;;
  crash) sleep 0.3; [ "$rank" = 0 ] && { summary 1; exit 1; }; sleep 30; exit 0 ;;
  wait)
    trap 'trap "" TERM; echo "node $rank got TERM" >> "$FAKE_DIR/nodes"; sleep 0.5; echo "final save done" >&2; exit 1' TERM
    touch "$FAKE_DIR/running-$rank"
    for i in $(seq 300); do sleep 0.1; done; exit 0 ;;
esac
"""


def _launcher(tmp_path, env: dict[str, str]):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL),
                       ("sinfo", "#!/bin/sh\nexit 0\n"), ("python", FAKE_TORCHRUN)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    fake = tmp_path / "fake"
    fake.mkdir()
    e = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "1234",
         "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path),
         "SLURM_JOB_PARTITION": "gpu", "TIERCKPT_HOME": str(REPO), "TIERCKPT_PYTHON": str(bindir / "python"),
         "TIERCKPT_LOCAL_ROOT": str(tmp_path / "nvme"), "FAKE_DIR": str(fake), **env}
    p = subprocess.Popen(["bash", str(REPO / "launch" / "titan.sbatch")], env=e, cwd=str(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, fake, tmp_path / ".tierckpt" / "slurm-1234"


def _events(state: Path) -> list[tuple[str, dict[str, str]]]:
    import re

    out = []
    for line in (state / "events").read_text().splitlines():
        parts = line.split(" ", 2)
        out.append((parts[1], dict(re.findall(r'(\w+)=("[^"]*"|\S+)', parts[2] if len(parts) > 2 else ""))))
    return out


def _calls(fake: Path) -> list[str]:
    f = fake / "calls"
    return [c for c in f.read_text().splitlines() if "show hostnames" not in c] if f.exists() else []


def test_worker_exit_75_requeues_instead_of_retrying(tmp_path):
    """A worker that saved for a preemption exits 75: one attempt, then `scontrol requeue`
    without excluding a node — not the retries a failure gets."""
    p, fake, state = _launcher(tmp_path, {"FAKE_MODE": "exit75", "TIERCKPT_MAX_ATTEMPTS": "3"})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    ev = _events(state)
    assert [k for k, _ in ev] == ["start", "end", "requeue"], ev
    assert ev[1][1]["preempted"] == "exit-75" and ev[2][1]["exclude"] == "-", ev
    assert "scontrol requeue 1234" in _calls(fake) and not any(c.startswith("scontrol update") for c in _calls(fake))
    assert (state / "attempts").read_text().strip() == "1"
    # the node script gives torchrun its shutdown timeout and the ranks see it (start-up check)
    for n in (0, 1):
        args = (fake / f"args-{n}").read_text()
        assert "--max-restarts=0 --shutdown-timeout=90 " in args and args.rstrip().endswith(
            "| TIERCKPT_SHUTDOWN_TIMEOUT=90"), args


def test_worker_crash_still_retried(tmp_path):
    """A crash on node 0 stops node 1 with SIGTERM (kill-on-bad-exit): not a preemption."""
    p, fake, state = _launcher(tmp_path, {"FAKE_MODE": "crash", "TIERCKPT_MAX_ATTEMPTS": "2",
                                          "TIERCKPT_MAX_REQUEUES": "0"})
    out, err = p.communicate(timeout=120)
    assert p.returncode != 0, err
    assert [k for k, _ in _events(state)] == ["start", "end", "start", "end", "give-up"], _events(state)
    # node 1's wrapper outlives the SIGTERM: its record says how torchrun ended, and the TERM
    recs = [(state / "attempt-0" / f"node-{n}.exit").read_text().split() for n in (0, 1)]
    assert recs == [["0", "gpu01", "1", "-"], ["1", "gpu02", "143", "TERM"]], recs


@pytest.mark.parametrize("sig,jobstate", [("SIGUSR1", "RUNNING"), ("SIGTERM", "RUNNING"), ("SIGTERM", "PENDING"),
                                          ("step", "RUNNING")])
def test_notice_to_batch_script_forwards_sigterm_and_requeues(tmp_path, sig, jobstate):
    """`--signal=B:USR1@…` (or a SIGTERM) to the batch script while training runs: SIGTERM to
    the training step (scancel, not srun), every node's wrapper outlives its workers' final save
    and writes its record, and the job is requeued once — unless Slurm is already ending it
    (JobState not RUNNING: scontrol requeue, preemption; Slurm signals the step itself), then
    nothing more is done. "step":
    Slurm's SIGTERM to the training step only (preemption with GraceTime), no notice to the
    batch script: every node got it, so it is a preemption too."""
    import signal
    import time

    p, fake, state = _launcher(tmp_path, {"FAKE_MODE": "wait", "FAKE_JOBSTATE": jobstate})
    deadline = time.time() + 30
    while not ((fake / "running-0").exists() and (fake / "running-1").exists()):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    if sig == "step" or jobstate != "RUNNING":  # Slurm's own SIGTERM to every process of the step
        for g in (fake / "groups").read_text().split():
            os.killpg(int(g), signal.SIGTERM)
    if sig != "step":
        p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=60)
    ev = _events(state)
    kinds = [k for k, _ in ev]
    if sig == "step":
        assert p.returncode == 0 and kinds == ["start", "end", "requeue"], (ev, err)
        assert ev[1][1]["preempted"] == "SIGTERM-to-step" and "scontrol requeue 1234" in _calls(fake), ev
        return
    # forwarded, unless Slurm is ending the job (it signals the step itself; scancel would hang)
    assert ("scancel --signal=TERM 1234" in _calls(fake)) == (jobstate == "RUNNING"), (_calls(fake), err)
    assert sorted((fake / "nodes").read_text().splitlines()) == [
        "node 0 attempt 0", "node 0 got TERM", "node 1 attempt 0", "node 1 got TERM"]
    for n in (0, 1):
        rec = (state / "attempt-0" / f"node-{n}.exit").read_text().split()
        assert rec == [str(n), f"gpu0{n + 1}", "1", "TERM"], rec
        assert "final save done" in (state / "attempt-0" / f"node-{n}.err").read_text()
    assert ev[1] == ("notice", {"signal": sig, "attempt": "1"}) and ev[2][1]["preempted"] == sig, ev
    if jobstate == "RUNNING":
        assert p.returncode == 0 and kinds == ["start", "notice", "end", "requeue"], (ev, err)
        assert "scontrol requeue 1234" in _calls(fake)
    else:
        assert p.returncode == 1 and kinds == ["start", "notice", "end", "slurm-ends"], (ev, err)
        assert "scontrol requeue 1234" not in _calls(fake)


# ----------------------------------------- a node lost for good: go on with fewer (TIERCKPT_MIN_NODES)
# srun over the hosts of --nodelist (else the first --nodes of gpu01..), one process group per
# node; sinfo reports the hosts listed in $FAKE_DIR/down as "down*"; the stand-in interpreter
# answers titan_plugin.elastic with fixed overrides (one word quoted) and plays torchrun: in the
# first attempt host $FAKE_LOSE dies (and Slurm marks it down), the others train until stopped.
SHRINK_SRUN = r"""#!/bin/bash
hosts=""; nodelist=""
for a in "$@"; do case "$a" in --nodelist=*) hosts=${a#*=}; nodelist=1 ;; esac; done
while [ $# -gt 0 ] && [ "$1" != bash ]; do shift; done
shift 2; script=$1; shift 2
[ -n "$hosts" ] || hosts=$(seq -s, -f 'gpu%02g' 1 "$TCK_NNODES")
echo "srun nodes=$TCK_NNODES hosts=$hosts" >> "$FAKE_DIR/calls"
set -m
pids=(); i=0; delay=0
[ -z "$nodelist" ] || delay=$(( $(tr , "\n" <<< "$hosts" | wc -l) ))
for h in ${hosts//,/ }; do
  # on a step over part of the allocation the later hosts start first (gpu03 before gpu02): the
  # chain of local-root moves must not depend on who is scheduled first
  delay=$((delay > 0 ? delay - 1 : 0))
  # FAKE_NODE_LOCAL: every host sees its own local root (a real cluster's node-local disks)
  [ -z "${FAKE_NODE_LOCAL:-}" ] || export TIERCKPT_LOCAL_ROOT="$FAKE_NODE_LOCAL/$h"
  ( sleep "$((delay * 3 / 10)).$((delay * 3 % 10))"; SLURM_NODEID=$i SLURMD_NODENAME=$h exec bash -c "$script" tierckpt-node "$@" ) &
  pids+=($!); i=$((i + 1))
done
rc=0
for _ in "${pids[@]}"; do
  wait -n; r=$?
  if [ "$r" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$r
    for p in "${pids[@]}"; do kill -TERM -- -"$p" 2>/dev/null; done
  fi
done
exit $rc
"""

SHRINK_SINFO = r"""#!/bin/bash
for h in gpu01 gpu02 gpu03; do
  if grep -qx "$h" "$FAKE_DIR/down" 2>/dev/null; then echo "$h down*"; else echo "$h alloc"; fi
done
"""

SHRINK_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
case "$1 $2" in
  "show hostnames") echo gpu01; echo gpu02; echo gpu03 ;;
  "show job") echo "JobId=1234 JobState=RUNNING ExcNodeList=(null)" ;;
  "requeue 1234") ;;
  "update jobid=1234") ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

SHRINK_PYTHON = r"""#!/bin/bash
if [ "$1 $2" = "-m titan_plugin.elastic" ]; then
  echo "elastic ${*:3}" >> "$FAKE_DIR/calls"
  echo "titan_plugin.elastic: warning: replication clamped" >&2
  echo "--checkpoint.replication_factor 2 --note 'a b'"; exit 0
fi
rank=; nn=; master=
for a in "$@"; do case "$a" in --node-rank=*) rank=${a#*=} ;; --nnodes=*) nn=${a#*=} ;; --master-addr=*) master=${a#*=} ;; esac; done
echo "attempt=$TIERCKPT_RESTART_COUNT host=$SLURMD_NODENAME rank=$rank nnodes=$nn master=$master tail=${*: -4} last=[${*: -1}]" >> "$FAKE_DIR/nodes"
if [ "$TIERCKPT_RESTART_COUNT" = 0 ]; then
  if [ "$SLURMD_NODENAME" = "$FAKE_LOSE" ]; then sleep 0.3; echo "$SLURMD_NODENAME" >> "$FAKE_DIR/down"; exit 1; fi
  for i in $(seq 300); do sleep 0.1; done
fi
exit 0
"""


def _shrink_job(tmp_path, env: dict[str, str], disks: tuple[int, ...] = (2,)):
    bindir, fake, nvme = tmp_path / "bin", tmp_path / "fake", tmp_path / "nvme"
    for d in (bindir, fake, *(nvme / f"node-{n}" for n in disks)):
        d.mkdir(parents=True)
    for n in disks:
        (nvme / f"node-{n}" / "marker").write_text(f"gpu0{n + 1}'s disk")
    for name, text in (("srun", SHRINK_SRUN), ("sinfo", SHRINK_SINFO), ("scontrol", SHRINK_SCONTROL),
                       ("scancel", "#!/bin/sh\nexit 0\n"), ("python", SHRINK_PYTHON)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    e = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "1234",
         "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_NUM_NODES": "3", "SLURM_SUBMIT_DIR": str(tmp_path),
         "SLURM_JOB_PARTITION": "gpu", "TIERCKPT_HOME": str(REPO), "TIERCKPT_PYTHON": str(bindir / "python"),
         "TIERCKPT_LOCAL_ROOT": str(nvme), "FAKE_DIR": str(fake), **env}
    r = subprocess.run(["bash", str(REPO / "launch" / "titan.sbatch")], env=e, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
    return r, fake, nvme, tmp_path / ".tierckpt" / "slurm-1234"


@pytest.mark.parametrize("lose,left", [("gpu02", ["gpu01", "gpu03"]), ("gpu01", ["gpu02", "gpu03"])])
def test_node_lost_for_good_goes_on_with_fewer(tmp_path, lose, left):
    """3 nodes, TIERCKPT_MIN_NODES=2: Slurm marks one host down after its node failed; the next
    attempt is a step on the 2 others (--nodelist), renumbered in order, the master its first
    host, torchrun --nnodes=2, with titan_plugin.elastic's overrides (for --nodes 2) appended;
    a host whose id changed takes its local root along."""
    r, fake, nvme, state = _shrink_job(tmp_path, {"FAKE_LOSE": lose, "TIERCKPT_MIN_NODES": "2"})
    assert r.returncode == 0, r.stderr
    ev = _events(state)
    assert [k for k, _ in ev] == ["start", "end", "shrink", "start", "end"], ev
    assert ev[1][1]["unhealthy"] == lose and ev[3][1]["nodes"] == ",".join(left), ev
    assert ev[2][1] == {"nodes": "2", "hosts": ",".join(left), "lost": lose,
                        "args": '"--checkpoint.replication_factor 2 --note a b"'}, ev
    calls = (fake / "calls").read_text().splitlines()
    assert "srun nodes=3 hosts=gpu01,gpu02,gpu03" in calls and f"srun nodes=2 hosts={','.join(left)}" in calls
    elastic = [c for c in calls if c.startswith("elastic ")]
    assert elastic == [f"elastic --nodes 2 --nproc-per-node 1 --shell -- --toml {REPO}/configs/titan_demo.toml "
                       f"--checkpoint.local_root {nvme}/node-{{node}}"], elastic
    second = sorted(x for x in (fake / "nodes").read_text().splitlines() if x.startswith("attempt=1 "))
    assert second == [f"attempt=1 host={h} rank={i} nnodes=2 master={left[0]} "
                      "tail=--checkpoint.replication_factor 2 --note a b last=[a b]" for i, h in enumerate(left)], second
    # gpu03 was node 2 and is node 1 now: its local root moved with it (after gpu02's turn: the
    # three hosts share this root, as .hosts shows, so the chain of moves goes in node order)
    assert sorted(p.name for p in nvme.iterdir() if p.name != ".hosts") == ["node-1"]
    assert sorted(p.name for p in (nvme / ".hosts").iterdir()) == ["gpu01", "gpu02", "gpu03"]
    assert (nvme / "node-1" / "marker").read_text() == "gpu03's disk"
    assert "going on with 2 nodes" in r.stderr and "warning: replication clamped" in r.stderr


@pytest.mark.parametrize("lose,moved", [
    ("gpu01", {"node-0": "gpu02's disk", "node-1": "gpu03's disk", ".lost-gpu01-1": "gpu01's disk"}),
    ("gpu02", {"node-0": "gpu01's disk", "node-1": "gpu03's disk", ".lost-gpu02-1": "gpu02's disk"}),
    ("gpu03", {"node-0": "gpu01's disk", "node-1": "gpu02's disk", "node-2": "gpu03's disk"}),
])
def test_a_lost_hosts_leftover_directory_on_a_shared_root_is_set_aside(tmp_path, lose, moved):
    """Every host's directory present on one shared root (nodes simulated on one machine): the
    lost host's directory is set aside (.lost-<host>-<attempt>) instead of being taken by the
    host renumbered onto its name, and the chain of moves goes on behind it."""
    r, _fake, nvme, _state = _shrink_job(tmp_path, {"FAKE_LOSE": lose, "TIERCKPT_MIN_NODES": "2"}, (0, 1, 2))
    assert r.returncode == 0, r.stderr
    got = {p.name: (p / "marker").read_text() for p in nvme.iterdir() if p.name != ".hosts"}
    assert got == moved, (got, r.stderr)
    if lose != "gpu03":
        assert f"of lost host {lose} set aside" in r.stderr


def test_node_local_roots_move_without_waiting(tmp_path):
    """Node-local roots (each host sees only its own): every renumbered host moves its directory
    at once, none waits for another's turn, and each root's .hosts names only its host."""
    disks = tmp_path / "disks"
    for n, h in enumerate(("gpu01", "gpu02", "gpu03")):
        (disks / h / f"node-{n}").mkdir(parents=True)
        (disks / h / f"node-{n}" / "marker").write_text(f"{h}'s disk")
    r, _fake, _nvme, _state = _shrink_job(tmp_path, {"FAKE_LOSE": "gpu01", "TIERCKPT_MIN_NODES": "2",
                                                     "FAKE_NODE_LOCAL": str(disks)}, ())
    assert r.returncode == 0, r.stderr
    for h, n in (("gpu02", 0), ("gpu03", 1)):
        assert sorted(p.name for p in (disks / h).iterdir()) == [".hosts", f"node-{n}"], h
        assert (disks / h / f"node-{n}" / "marker").read_text() == f"{h}'s disk"
        assert [p.name for p in (disks / h / ".hosts").iterdir()] == [h]
    assert "did not move out" not in r.stderr and "set aside" not in r.stderr, r.stderr


def test_node_lost_below_min_nodes_requeues(tmp_path):
    """TIERCKPT_MIN_NODES=3 on 3 nodes (the default): a lost node requeues the job as before."""
    r, fake, nvme, state = _shrink_job(tmp_path, {"FAKE_LOSE": "gpu02", "TIERCKPT_MIN_NODES": "3"})
    assert r.returncode == 0, r.stderr
    assert [k for k, _ in _events(state)] == ["start", "end", "requeue"], _events(state)
    assert "fewer than TIERCKPT_MIN_NODES=3" in r.stderr
    assert "scontrol requeue 1234" in (fake / "calls").read_text()
    assert not any(c.startswith("elastic ") for c in (fake / "calls").read_text().splitlines())
