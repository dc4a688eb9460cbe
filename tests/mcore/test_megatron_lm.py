"""Real Megatron-LM: unmodified ``pretrain_gpt.py`` under ``python -m mcore_plugin.pretrain``.

Two gloo ranks on CPU, each rank a simulated node, mock data, a tiny GPT with the
distributed optimizer. Needs a Megatron-LM checkout whose ``megatron/core`` matches a supported
megatron-core (``MEGATRON_LM_DIR``; ``make test-megatron-lm`` gets core_v0.16.1 and sets it).

Scenarios (issue 5, point 6), each compared with one uninterrupted reference run (40
iterations, local tier + replica on the other node every 2, persistent tier every 20):

1. ``..._from_replica_then_persistent``: attempt 1 is SIGKILLed once the ledger shows a
   committed (replicated) local step >= 4: node 1 first, its whole local root deleted, then
   node 0. Attempt 2 (same command line) resumes node 0 from its own copy and node 1 from
   node 0's replica through Megatron-LM's ``--non-persistent-ckpt-type local`` path, served
   by the plugin, reading no persistent byte. It is killed again once persistent step 20
   and a later local step exist, and every local root is deleted: attempt 3 resumes both
   nodes at 20 from the persistent tier and finishes.
2. ``..._persistent_tier_only``: the plugin without a local tier; Megatron's own tracker /
   ``iter_N`` load path goes through the hooked strategies (``--exit-interval 20``, resume).
3. ``..._ckpt_step_is_honoured_with_the_local_tier`` (issue 14, item 6): ``--ckpt-step 4``
   with persistent 4 and 8 and no local roots resumes at 4; the rollback supersedes 8 at the
   relaunch's first commit, and the next plain restart resumes the new timeline.
4. ``..._corrupt_newest_local_step_falls_back`` (issue 14, item 4): node 1's newest local step
   corrupt in both copies; the relaunch resumes at the previous local step.

Checks: the ledger's restore records (step, per-node source, persistent bytes), the logged
losses after each resume equal the reference's (compared as printed strings), and the final
persistent checkpoints (model + optimizer, every tensor) are bitwise equal to the reference's.
Dropout is 0: Megatron's own torch_dist resume on CPU does not reproduce the dropout stream
either (measured with stock Megatron-LM 0.16.1: same post-resume losses as the plugin's), so
dropout would only test Megatron's RNG handling, not the checkpoint tiers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MLM = os.environ.get("MEGATRON_LM_DIR", "")
ITERS = 40


def _checkout_problem() -> str | None:
    if not MLM:
        return ("MEGATRON_LM_DIR is not set: this test needs a Megatron-LM checkout "
                "(make test-megatron-lm and make test-megatron-lm-019 get one and run it)")
    p = Path(MLM)
    if not (p / "pretrain_gpt.py").is_file() or not (p / "megatron" / "training").is_dir():
        return f"MEGATRON_LM_DIR={MLM} has no pretrain_gpt.py / megatron/training"
    return None


pytestmark = pytest.mark.skipif(_checkout_problem() is not None, reason=_checkout_problem() or "")


def _checkout_version() -> tuple[int, int]:
    text = (Path(MLM) / "megatron" / "core" / "package_info.py").read_text()
    major = int(re.search(r"^MAJOR\s*=\s*(\d+)", text, re.M).group(1))
    minor = int(re.search(r"^MINOR\s*=\s*(\d+)", text, re.M).group(1))
    return major, minor


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
    "--train-iters", str(ITERS), "--seed", "1234",
]


def _plugin_args(root: Path, local: bool = True) -> list[str]:
    args = ["--save", str(root / "ckpt"), "--save-interval", "20", "--ckpt-plugin-enable",
            "--ckpt-plugin-simulated-ranks-per-node", "1", "--ckpt-plugin-job-id", "mlm-test"]
    if local:
        args += ["--ckpt-plugin-local-interval", "2", "--ckpt-plugin-local-root", str(root / "local" / "node-{node}"),
                 "--ckpt-plugin-replication-jump", "1", "--ckpt-plugin-replication-factor", "2"]
    return args


def _env(rank: int, port: int) -> dict:
    env = dict(os.environ)
    # Megatron-LM compiles megatron/core/datasets/helpers.cpp with `python3 -m pybind11` and
    # `python3-config` from PATH: this interpreter's venv first, then its base installation.
    base_bin = os.path.join(sys.base_prefix, "bin")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), base_bin, env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1")
    env.pop("TIERCKPT_NODE_ID", None)
    return env


def _start(root: Path, log_name: str, local: bool = True, extra: list[str] = ()) -> list[tuple[subprocess.Popen, Path]]:
    port = _free_port()
    procs = []
    cmd = [sys.executable, "-m", "mcore_plugin.pretrain", str(Path(MLM) / "pretrain_gpt.py"),
           *MODEL_ARGS, *_plugin_args(root, local), *extra]
    for rank in range(2):
        log = root / f"{log_name}.rank{rank}.log"
        f = open(log, "w")
        procs.append((subprocess.Popen(cmd, env=_env(rank, port), stdout=f, stderr=subprocess.STDOUT,
                                       cwd=str(root), start_new_session=True), log))
    return procs


def _wait(procs, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            pytest.fail(f"Megatron-LM run timed out; log tail:\n{_tail(log)}")
    for p, log in procs:
        assert p.returncode == 0, f"rank exited {p.returncode}; log tail:\n{_tail(log)}"


def _tail(log: Path, n: int = 60) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def _losses(log: Path) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in _LOSS.finditer(log.read_text(errors="replace"))}


def _ledger(root: Path) -> list[dict]:
    path = root / "ckpt" / "tierckpt-ledger.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line while rank 0 appends
    return out


def _tensors(step_dir: Path) -> dict:
    """Every tensor of a torch_dist checkpoint directory (DCP), read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / (step_dir.name + ".pt")
    dcp_to_torch_save(str(step_dir), str(out))
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _kill_when(procs, root: Path, ready, what: str, timeout_s: float = 300.0):
    """Poll the ledger until ``ready(records)`` returns a value; fail if a rank ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ready(_ledger(root))
        if got:
            return got
        if any(p.poll() is not None for p, _ in procs):
            break
        time.sleep(0.02)
    for q, _ in procs:
        q.kill()
    rcs = [p.poll() for p, _ in procs]
    pytest.fail(f"no kill point ({what}) before the ranks ended (rc {rcs}) or within {timeout_s}s; training may "
                f"have outrun the ledger poll:\n{_tail(procs[-1][1])}")


def _committed(records, tier: str) -> list[int]:
    return [r["step"] for r in records if r.get("kind") == "checkpoint" and r.get("tier") == tier and r.get("ok")]


def _restores_of_last_run(root: Path) -> list[dict]:
    ledger = _ledger(root)
    last_start = max(i for i, r in enumerate(ledger) if r.get("kind") == "run_start")
    return [r for r in ledger[last_start:] if r.get("kind") == "restore"]


def _check_resumed(ref_losses, log: Path, step: int) -> None:
    after = _losses(log)
    assert min(after) == step + 1, f"did not continue at {step + 1}: {sorted(after)[:3]}"
    # Megatron's second log line after a resume averages two iterations (its loss accumulator
    # restarts); every later iteration is compared exactly.
    compared = list(range(step + 3, ITERS + 1))
    assert compared, "resumed too late to compare"
    diff = {i: (ref_losses[i], after[i]) for i in compared if ref_losses[i] != after[i]}
    assert not diff, f"losses after the resume differ from the reference: {diff}"


def _check_final_state(ref: Path, run: Path) -> int:
    import torch

    a, b = _tensors(ref / "ckpt" / f"step-{ITERS}"), _tensors(run / "ckpt" / f"step-{ITERS}")
    assert a.keys() == b.keys()
    assert any("exp_avg_sq" in k for k in a), "optimizer state missing from the checkpoint"
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"final state differs from the reference in {unequal[:5]}"
    return len(a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (local every 2, persistent every 20): losses and final state."""
    major_minor = _checkout_version()
    from mcore_plugin.install import HOOK_SPECS

    assert major_minor in HOOK_SPECS, f"checkout's megatron-core {major_minor} has no hooks"
    ref = tmp_path_factory.mktemp("reference")
    _wait(_start(ref, "ref"))
    losses = _losses(ref / "ref.rank1.log")  # Megatron logs iterations on the last rank
    assert sorted(losses) == list(range(1, ITERS + 1)), "reference did not log every iteration"
    return ref, losses, major_minor


def test_pretrain_gpt_kill_node_resume_from_replica_then_persistent(reference, tmp_path):
    ref, ref_losses, major_minor = reference
    run = tmp_path / "failure"
    run.mkdir()

    # attempt 1: node 1 dies with its disk once a replicated local step >= 4 is committed
    procs = _start(run, "attempt1")
    killed_at = _kill_when(procs, run, lambda recs: max([s for s in _committed(recs, "local") if s >= 4],
                                                        default=None), "local step >= 4")
    os.killpg(procs[1][0].pid, signal.SIGKILL)  # node 1 dies ...
    procs[1][0].wait()
    shutil.rmtree(run / "local" / "node-1")  # ... with its disk
    os.killpg(procs[0][0].pid, signal.SIGKILL)  # the job loses its process group
    procs[0][0].wait()
    attempt1 = _losses(run / "attempt1.rank1.log")
    assert max(attempt1) < ITERS, "attempt 1 reached the end before the kill"
    for i in range(1, max(attempt1) + 1):
        assert attempt1[i] == ref_losses[i], (i, attempt1[i], ref_losses[i])

    # attempt 2: same command line; node 1 comes back from node 0's replica. It is killed
    # again, with both nodes' disks, once persistent step 20 and a later local step exist.
    procs = _start(run, "attempt2")
    _kill_when(procs, run, lambda recs: 20 in _committed(recs, "persistent")
               and any(s > 20 for s in _committed(recs, "local")), "persistent 20 and a later local step")
    for p, _ in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    restores = _restores_of_last_run(run)
    # Megatron-LM loads in two passes (common state on its "rank-0" pass, then everything): the
    # first reads only the common state from one verified node-local copy (no restore record, no
    # pull); the second is the one restore: node 1's files pulled from node 0's replica.
    assert len(restores) == 1, restores
    (only,) = restores
    step = only["step"]
    assert step >= killed_at, (step, killed_at)
    assert only["sources"]["0"]["source"] == "own-local", only
    assert only["sources"]["1"]["source"] == "peer-replica" and only["sources"]["1"]["holder"] == 0, only
    assert only["persistent_bytes"] == 0, only
    attempt2 = _losses(run / "attempt2.rank1.log")
    assert max(attempt2) < ITERS, "attempt 2 reached the end before the kill"
    compared = [i for i in range(step + 3, max(attempt2) + 1)]
    assert compared and all(attempt2[i] == ref_losses[i] for i in compared), \
        {i: (ref_losses[i], attempt2[i]) for i in compared if attempt2[i] != ref_losses[i]}

    # attempt 3: every local disk is gone: both nodes restore step 20 from the persistent tier
    # (written fully_reshardable; the template is rebuilt in that format) and finish the run
    shutil.rmtree(run / "local")
    _wait(_start(run, "attempt3"))
    restores = _restores_of_last_run(run)
    assert restores and all(r["step"] == 20 for r in restores), restores
    assert {v["source"] for v in restores[-1]["sources"].values()} == {"persistent"}, restores[-1]
    assert restores[-1]["persistent_bytes"] > 0
    _check_resumed(ref_losses, run / "attempt3.rank1.log", 20)
    n = _check_final_state(ref, run)
    print(f"\nMegatron-LM {major_minor}: killed after local step {killed_at}, resumed at {step} (node 0 own-local, "
          f"node 1 peer-replica, 0 persistent bytes); all local disks lost, resumed at 20 from persistent; "
          f"{n} tensors bitwise equal to the reference at step {ITERS}")


def test_pretrain_gpt_persistent_tier_only(reference, tmp_path):
    """Plugin without a local tier: Megatron's own --save/--load path (tracker file, iter_N)
    goes through the TieredSaveStrategy/TieredLoadStrategy hooks of this megatron-core."""
    ref, ref_losses, major_minor = reference
    run = tmp_path / "persistent-only"
    run.mkdir()
    _wait(_start(run, "attempt1", local=False, extra=["--exit-interval", "20"]))
    assert max(_losses(run / "attempt1.rank1.log")) == 20
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert (run / "ckpt" / "iter_0000020" / "common.pt").exists()  # what Megatron-LM's load reads first
    _wait(_start(run, "attempt2", local=False))
    restores = _restores_of_last_run(run)
    assert len(restores) == 1 and restores[0]["step"] == 20, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"persistent"}
    _check_resumed(ref_losses, run / "attempt2.rank1.log", 20)
    n = _check_final_state(ref, run)
    print(f"\nMegatron-LM {major_minor}: persistent tier only, resumed at 20 through Megatron's tracker path; "
          f"{n} tensors bitwise equal at step {ITERS}")


def test_pretrain_gpt_planned_exit_after_a_local_only_save_is_durable(reference, tmp_path):
    """Issue 14, item 5: local every 2, persistent every 20, ``--exit-interval 6``: Megatron's
    exit follows a local-only save at 6 (which it counts as its exit save). The plugin still
    commits persistent step 6 before the exit, so a requeue onto fresh nodes (every local root
    wiped) resumes at 6 from the persistent tier, with the reference's losses."""
    ref, ref_losses, _ = reference
    run = tmp_path / "run"
    run.mkdir()
    _wait(_start(run, "attempt1", extra=["--exit-interval", "6"]))
    recs = _ledger(run)
    assert 6 in _committed(recs, "persistent"), _committed(recs, "persistent")
    ends = [r for r in recs if r.get("kind") == "run_end"]
    assert ends and ends[-1]["clean"] is True and ends[-1]["durable_step"] == 6, ends
    shutil.rmtree(run / "local")
    _wait(_start(run, "attempt2"))
    restores = _restores_of_last_run(run)
    # (a persistent-only resume of Megatron-LM restores in both of its load passes)
    assert restores and {r["step"] for r in restores} == {6}, restores
    assert {v["source"] for r in restores for v in r["sources"].values()} == {"persistent"}, restores
    _check_resumed(ref_losses, run / "attempt2.rank1.log", 6)
    _check_final_state(ref, run)


def _check_resumed_until(ref_losses, log: Path, step: int, last: int) -> None:
    """Resumed at ``step + 1`` and, from ``step + 3`` (see :func:`_check_resumed`) to ``last``,
    losses equal to the uninterrupted reference."""
    after = _losses(log)
    assert min(after) == step + 1 and max(after) == last, f"resumed at {min(after)}, ended at {max(after)}"
    compared = list(range(step + 3, last + 1))
    diff = {i: (ref_losses[i], after[i]) for i in compared if ref_losses[i] != after[i]}
    assert compared and not diff, f"losses after the resume differ from the reference: {diff}"


def test_pretrain_gpt_ckpt_step_is_honoured_with_the_local_tier(reference, tmp_path):
    """Issue 14, item 6: persistent steps 4 and 8, every local root lost; ``--ckpt-step 4``
    with the local tier on resumes at 4 (from the persistent tier), as stock Megatron does
    without it. The relaunch trains on, so it is a rollback: persistent 8 stays a resume point
    until the relaunch's first commit (local step 6), then it is superseded and Megatron's
    tracker no longer names it. The relaunch exits at 6; the next plain restart resumes the
    new timeline at 6, with losses equal to the uninterrupted run."""
    ref, ref_losses, major_minor = reference
    run = tmp_path / "ckpt-step"
    run.mkdir()
    every4 = ["--save-interval", "4"]
    _wait(_start(run, "attempt1", extra=[*every4, "--exit-interval", "8"]))
    assert max(_losses(run / "attempt1.rank1.log")) == 8
    assert {4, 8} <= set(_committed(_ledger(run), "persistent"))
    shutil.rmtree(run / "local")
    _wait(_start(run, "attempt2", extra=[*every4, "--ckpt-step", "4", "--exit-interval", "6"]))
    restores = _restores_of_last_run(run)
    assert restores and all(r["step"] == 4 for r in restores), restores
    assert {v["source"] for v in restores[-1]["sources"].values()} == {"persistent"}, restores[-1]
    after = _losses(run / "attempt2.rank1.log")
    assert (min(after), max(after)) == (5, 6), sorted(after)
    ledger = _ledger(run)
    last_start = max(i for i, r in enumerate(ledger) if r.get("kind") == "run_start")
    run2 = ledger[last_start:]
    (rb,) = [r for r in run2 if r.get("kind") == "rollback"]
    assert (rb["from_step"], rb["to_step"]) == (8, 4) and "persistent/8" in rb["superseded"], rb
    first_commit = next(r for r in run2 if r.get("kind") == "checkpoint" and r.get("ok"))
    assert run2.index(rb) > run2.index(first_commit), "superseded before the relaunch committed a step"
    assert (run / "ckpt" / "step-8" / "tierckpt.committed.superseded").exists()
    assert int((run / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) < 8

    _wait(_start(run, "attempt3", extra=[*every4, "--exit-interval", "12"]))
    restores = _restores_of_last_run(run)
    assert restores and restores[-1]["step"] == 6, restores
    _check_resumed_until(ref_losses, run / "attempt3.rank1.log", 6, 12)
    print(f"\nMegatron-LM {major_minor}: --ckpt-step 4 with the local tier resumed at 4 (persistent 8 existed); "
          f"rollback at {rb['trigger']}; the next restart resumed at 6, losses 9..12 equal the reference")


def test_pretrain_gpt_corrupt_newest_local_step_falls_back(reference, tmp_path):
    """Issue 14, item 4: the newest local step N of node 1 is corrupt in its own copy and in
    its replica on node 0 (one byte flipped in each). The relaunch (same command line) goes
    through Megatron's local-checkpoint path, which resumes from the newest step that passes
    verification (the previous local step), not a NoCheckpointError on every restart."""
    from tests.mcore.scenarios import _flip_byte
    from tierckpt.cli import find_steps

    ref, ref_losses, major_minor = reference
    run = tmp_path / "corrupt-newest"
    run.mkdir()
    keep = ["--ckpt-plugin-local-keep", "3"]  # two steps every node committed survive the kill
    procs = _start(run, "attempt1", extra=keep)
    _kill_when(procs, run, lambda recs: any(s >= 6 for s in _committed(recs, "local")), "local step >= 6")
    for p, _ in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    own = {n: {s.step for s in find_steps(str(run / "local")) if s.committed and s.tier == "local" and s.node == n}
           for n in (0, 1)}
    both = sorted(own[0] & own[1])
    assert len(both) >= 2, own
    newest, previous = both[-1], both[-2]
    _flip_byte(str(run / "local" / "node-1" / "local" / f"step-{newest}"))
    replica = run / "local" / "node-0" / "replicas" / "node-1" / f"step-{newest}"
    if replica.exists():  # absent when the kill came before its replication finished
        _flip_byte(str(replica))
    last = previous + 8
    _wait(_start(run, "attempt2", extra=[*keep, "--exit-interval", str(last)]))
    restores = _restores_of_last_run(run)
    assert restores and restores[-1]["step"] == previous, restores
    assert any(f["step"] == newest and f["node"] == 1 for f in restores[-1]["failures"]), restores[-1]
    _check_resumed_until(ref_losses, run / "attempt2.rank1.log", previous, last)
    print(f"\nMegatron-LM {major_minor}: local step {newest} corrupt on node 1 and its replica; resumed at "
          f"{previous}, losses equal to the reference up to {last}")
