"""torchtitan resume semantics: a final model-only export is never a resume point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from pytest import approx


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, steps, *extra, nproc=2, ok=True, check=None):
    from tests.harness import titan_train_cmd

    cmd = [*titan_train_cmd(nproc),
           "--dump_folder", os.path.join(tmp, "run"), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "3", "--checkpoint.interval", "3", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    if (ok if check is None else check):
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _ledger(ckpt):
    return [json.loads(x) for x in open(os.path.join(ckpt, "tierckpt-ledger.jsonl"))]


def _losses(tmp):
    """{step: exact loss (hex)} of ``<tmp>/run``, the last record of each step."""
    return {r["step"]: r["loss_hex"] for r in map(json.loads, open(os.path.join(tmp, "run", "metrics", "losses.jsonl")))}


def test_last_step_is_durable_and_a_model_only_export_is_never_a_resume_point(tmp_path):
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "run", "checkpoint")
    # a bf16 model-only export needs its own step-N: the persistent tier must live elsewhere
    r = _train(tmp, 4, "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16",
               check=False)
    assert r.returncode != 0 and "error: checkpoint.persistent_folder" in r.stderr, r.stderr[-3000:]
    pfs = os.path.join(tmp, "pfs")
    _train(tmp, 4, "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16",
           "--checkpoint.persistent_folder", pfs)
    # torchtitan's model-only export of the last step is there, without a commit marker ...
    assert os.path.exists(os.path.join(ckpt, "step-4", ".metadata"))
    assert not os.path.exists(os.path.join(ckpt, "step-4", "tierckpt.committed"))
    # ... and the planned exit committed the full state of step 4 to the persistent tier
    assert os.path.exists(os.path.join(pfs, "step-4", "tierckpt.committed"))
    _train(tmp, 6, "--checkpoint.persistent_folder", pfs)
    recs = [json.loads(x) for x in open(os.path.join(pfs, "tierckpt-ledger.jsonl"))]
    restores = [r for r in recs if r["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 4, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}


def _tb_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every TensorBoard event file under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for d, _, files in os.walk(folder):
        if any(f.startswith("events.out.tfevents") for f in files):
            acc = EventAccumulator(d, size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_fp32_model_only_export_is_the_committed_full_last_step(tmp_path):
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "run", "checkpoint")
    _train(tmp, 4, "--checkpoint.last_save_model_only", "true")
    assert os.path.exists(os.path.join(ckpt, "step-4", "tierckpt.committed"))
    # the requeue lands on fresh nodes: only the persistent tier is left
    shutil.rmtree(os.path.join(tmp, "nvme"))
    _train(tmp, 6, "--metrics.enable_tensorboard", "true")
    recs = [json.loads(x) for x in open(os.path.join(ckpt, "tierckpt-ledger.jsonl"))]
    restores = [r for r in recs if r["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 4, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"persistent"}
    ends = [r for r in recs if r["kind"] == "run_end"]
    assert [e["durable_step"] for e in ends] == [4, 6] and all(e["clean"] for e in ends), ends

    # torchtitan's metric logger got the restore, the last save's δ and both tiers' records
    tb = _tb_scalars(os.path.join(tmp, "run", "tb"))
    assert tb["tierckpt/restore/step"] == [(4, 4.0)] and tb["tierckpt/restore/nodes/persistent"] == [(4, 2.0)]
    # (TensorBoard keeps float32: byte counts to 7 digits)
    assert restores[0]["persistent_bytes"] > 0
    assert tb["tierckpt/restore/persistent_bytes"] == [(4, approx(restores[0]["persistent_bytes"], rel=1e-6))]
    assert [s for s, _ in tb["tierckpt/save/blocking_s"]] == [6]
    saves = {r["tier"]: r for r in recs if r["kind"] == "checkpoint" and r["step"] == 6}
    for tier in ("local", "persistent"):
        assert tb[f"tierckpt/save/{tier}/step"] == [(6, 6.0)] and tb[f"tierckpt/save/{tier}/failed"] == [(6, 0.0)]
        assert tb[f"tierckpt/save/{tier}/bytes"] == [(6, approx(saves[tier]["bytes"], rel=1e-6))]


def _make_seed(tmp):
    """Seed checkpoint on one rank with the demo TOML unchanged (its J/F are for training).
    Its init (debug.seed 1234) differs from the demo's own, so a run that ignored the seed
    would have other losses."""
    _train(tmp, 4, "--checkpoint.create_seed_checkpoint", "true", "--debug.seed", "1234", nproc=1)
    return os.path.join(tmp, "run", "checkpoint", "step-0")


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory) -> str:
    """A folder holding the dump folder of one seed-creation run (:func:`_make_seed`), made once
    for the tests that load it; each copies it (:func:`_copy_seed_run`) and changes its copy only."""
    src = str(tmp_path_factory.mktemp("seed"))
    _make_seed(src)
    return src


def _copy_seed_run(src: str, tmp: str) -> str:
    """``src``'s dump folder copied to ``tmp`` (the state a seed run in ``tmp`` leaves); returns the seed."""
    shutil.copytree(os.path.join(src, "run"), os.path.join(tmp, "run"))
    return os.path.join(tmp, "run", "checkpoint", "step-0")


def test_seed_checkpoint_is_loaded_model_only_then_resumes_full_state(tmp_path, seed_run):
    from torch.distributed.checkpoint import FileSystemReader

    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "run", "checkpoint")
    seed = _copy_seed_run(seed_run, tmp)
    # model only, checksummed, no commit marker (never a resume point), no local tier written
    assert os.path.exists(os.path.join(seed, ".metadata")) and os.path.exists(os.path.join(seed, "tierckpt.seed.json"))
    assert not os.path.exists(os.path.join(seed, "tierckpt.committed"))
    assert not os.path.exists(os.path.join(seed_run, "nvme"))
    keys = FileSystemReader(seed).read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in keys
    assert not [k for k in keys if k.split(".")[0] in ("optimizer", "dataloader", "lr_scheduler", "train_state")]

    _train(tmp, 4)  # 2 ranks: starts from the seed's weights, fresh optimizer/dataloader/step
    # the same seed loaded by torchtitan's own model-only initial load, in another folder
    ref = os.path.join(tmp, "ref")
    _train(ref, 4, "--checkpoint.initial_load_path", seed)
    got = _losses(tmp)
    assert sorted(got) == [1, 2, 3, 4] and got == _losses(ref), (got, _losses(ref))
    recs = _ledger(ckpt)
    restores = [r for r in recs if r["kind"] == "restore"]
    assert len(restores) == 1, restores
    assert restores[0]["step"] == 0 and restores[0]["model_only"] is True and restores[0]["checksummed"] is True
    assert {v["source"] for v in restores[0]["sources"].values()} == {"seed"} and len(restores[0]["sources"]) == 2
    assert [r["clean"] for r in recs if r["kind"] == "run_end"] == [True]

    # a seed torchtitan wrote itself (DCP files only, no tierckpt checksums) is loaded too
    stock = os.path.join(tmp, "stock")
    shutil.copytree(seed, os.path.join(stock, "run", "checkpoint", "step-0"),
                    ignore=shutil.ignore_patterns("tierckpt.*"))
    _train(stock, 1)
    assert _losses(stock) == {1: got[1]}
    restores = [r for r in _ledger(os.path.join(stock, "run", "checkpoint")) if r["kind"] == "restore"]
    assert [(r["step"], r["model_only"], r["checksummed"]) for r in restores] == [(0, True, False)]

    # a restart resumes the run's own committed step (full state), not the seed
    _train(tmp, 6)
    restores = [r for r in _ledger(ckpt) if r["kind"] == "restore"]
    assert len(restores) == 2 and restores[1]["step"] == 4 and "model_only" not in restores[1], restores
    assert {v["source"] for v in restores[1]["sources"].values()} == {"own-local"}
    steps = [json.loads(x)["step"] for x in open(os.path.join(tmp, "run", "metrics", "losses.jsonl"))]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    # the seed is kept (retention never deletes it) and still is no resume point
    assert os.path.exists(os.path.join(seed, "tierckpt.seed.json"))
    assert not os.path.exists(os.path.join(seed, "tierckpt.committed"))

    # training from the seed by name over committed steps would write over them: refused
    before = sorted(os.listdir(ckpt))
    r = _train(tmp, 8, "--checkpoint.load_step", "0", ok=False)
    assert r.returncode != 0 and "checkpoint.load_step" in r.stderr and "[3, 4, 6]" in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == before
    assert len([x for x in _ledger(ckpt) if x["kind"] == "restore"]) == 2


def test_corrupt_seed_checkpoint_stops_the_run(tmp_path, seed_run):
    tmp = str(tmp_path)
    seed = _copy_seed_run(seed_run, tmp)
    data = os.path.join(seed, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    r = _train(tmp, 2, ok=False)
    assert r.returncode != 0
    assert "seed checkpoint" in r.stderr and "corrupt" in r.stderr and "__0_0.distcp" in r.stderr, r.stderr[-3000:]
    recs = _ledger(os.path.join(tmp, "run", "checkpoint"))
    assert not [x for x in recs if x["kind"] in ("restore", "checkpoint")], recs
    assert not os.path.exists(os.path.join(tmp, "run", "checkpoint", "step-2"))


def test_seed_folder_states(tmp_path):
    """What the next run makes of step-0: a tierckpt seed (checksums), a seed torchtitan wrote
    (DCP files only), an interrupted seed creation (refused, never loaded as complete), or none."""
    from tierckpt.io.storage import Store
    from titan_plugin.manager import SEED_MANIFEST, _find_seed

    store, rel = Store(str(tmp_path)), "step-0"
    assert _find_seed(store, rel) is None
    store.write_atomic(f"{rel}/.metadata", b"x")
    assert _find_seed(store, rel) == ("torchtitan", None)
    store.write_atomic(f"{rel}/tierckpt.inprogress", b"x")  # creation started, not finished
    assert _find_seed(store, rel) == ("torn", None)
    store.remove(f"{rel}/tierckpt.inprogress")
    store.write_atomic(f"{rel}/{SEED_MANIFEST}", b'{"format": "tierckpt-manifest", "model_only": true, "files": []}')
    assert _find_seed(store, rel)[0] == "tierckpt"
    store.write_atomic(f"{rel}/{SEED_MANIFEST}", b'{"format": "tierck')
    assert _find_seed(store, rel) == ("torn", None)
    store.remove(f"{rel}/{SEED_MANIFEST}")
    store.write_atomic(f"{rel}/tierckpt.committed", b"{}")  # a full step 0 is the engine's business
    assert _find_seed(store, rel) is None
