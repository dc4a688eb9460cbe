"""Resume on a different rank count (2 → 1), resharded: in-cluster, then from the persistent tier.

1. A 2-rank torchtitan job (llama3 debugmodel, FSDP2 over gloo, 2 simulated nodes,
   ``replication_factor = 2``, configs/titan_demo.toml) trains K steps with the local tier and
   the persistent tier both saving at step K (a full save: ``last_save_model_only = false``).
   After training, each rank computes the loss of the fixed batch (the whole batch on every
   rank) under ``no_grad``.
2. A 1-rank process builds the trainer from the same config (``replication_factor = 1``: one
   node cannot hold a replica), calls ``trainer.checkpointer.load()`` and computes the loss of
   the same fixed batch. Node 0's disk holds its own half of every sharded tensor and its
   replica of node 1's half: the restore reads both in-cluster, resharding 2 → 1, without a
   persistent byte. The dataloader state is loaded too: the demo corpus is repositioned from 2
   data-parallel ranks to 1 (titan_plugin/dataloader.py).
3. Node 0's replica of node 1 is deleted and the 1-rank restore runs again: node 1's chunks are
   in no in-cluster copy, so it loads the persistent tier and the ledger names the missing chunks.

Both restores give the same loss, bitwise, which agrees with the 2-rank loss within float tolerance.

Run as a script, this file is the rank helper the test starts:
``python tests/test_titan_reshard.py --mode {train,restore} --result FILE [--section.key value …]``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOML = REPO / "configs" / "titan_demo.toml"
K = 4  # steps of the 2-rank job; both tiers save at step K


# ------------------------------------------------------------------------------- rank helper
def fixed_batch(trainer):
    """The first batch of a fresh single-rank dataloader over the demo corpus: the same token
    ids (and per-document positions) in every process, whatever its rank count."""
    cfg = trainer.config
    dl = cfg.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=trainer.tokenizer,
                              seq_len=cfg.training.seq_len, local_batch_size=cfg.training.local_batch_size)
    input_dict, labels = next(iter(dl))
    return input_dict, labels


def fixed_batch_loss(trainer) -> float:
    """Mean cross-entropy of the model on :func:`fixed_batch` (fp32, no_grad)."""
    import torch
    import torch.nn.functional as F
    from torchtitan.components.loss import IGNORE_INDEX

    input_dict, labels = fixed_batch(trainer)
    input_dict = {k: v.to(trainer.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
    labels = labels.to(trainer.device)
    model = trainer.model_parts[0]
    with torch.no_grad():
        inputs, labels, extra = trainer.post_dataloading_process(input_dict, labels)
        out = model(inputs, **extra)
        # with torchtitan's ChunkedLossWrapper the decoder stops before lm_head (_skip_lm_head)
        logits = model.lm_head(out) if getattr(model, "_skip_lm_head", False) else out
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    return float(loss)


def _dataloader_outcome(trainer) -> dict:
    """How the checkpointer positioned the dataloader, and where it now reads (epoch, row view)."""
    positions = getattr(trainer.checkpointer, "positions", None)
    ds = trainer.dataloader.dataset
    view = getattr(ds, "_tierckpt_view", None)
    return {"outcome": getattr(positions, "outcome", None), "epoch": ds._epoch, "sample_idx": ds._sample_idx,
            "view": None if view is None else [list(r) for r in view[1]], "shard_len": len(ds._original_data),
            "buffer": len(ds._inputs_buffer)}


def helper(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("train", "restore"), required=True)
    ap.add_argument("--result", required=True)
    args, rest = ap.parse_known_args(argv)

    import torch
    from torchtitan.tools.logging import init_logger

    from tierckpt_dev.titan.cpu import apply_cpu_compat
    from titan_plugin.toml import load_config

    init_logger()
    apply_cpu_compat()
    config = load_config(str(TOML), rest)
    trainer = config.build()
    try:
        before = None
        if args.mode == "train":
            trainer.train()
        else:
            before = fixed_batch_loss(trainer)  # freshly initialised model
            trainer.checkpointer.load(step=config.checkpoint.load_step)
        loss = fixed_batch_loss(trainer)
        res = getattr(trainer.checkpointer, "last_restore", None)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        out = {"mode": args.mode, "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")),
               "step": trainer.step, "loss": loss, "loss_hex": loss.hex(), "loss_before_load": before,
               "restored_from": None if res is None else {str(n): o.source.kind for n, o in res.sources.items()},
               "dataloader": _dataloader_outcome(trainer)}
        with open(f"{args.result}.rank{rank}", "w") as f:
            json.dump(out, f)
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(helper(sys.argv[1:]))


# -------------------------------------------------------------------------------------- test
import pytest  # noqa: E402



from tests.harness import TITAN_TEST_ARGS, load_demo_launcher  # noqa: E402


def _launcher():
    return load_demo_launcher()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _common(tmp_path: Path) -> list[str]:
    """The flags every phase of a test shares: its dump folder and node-local roots under
    ``tmp_path``, both tiers saving a full step K."""
    return [*TITAN_TEST_ARGS, "--dump_folder", str(tmp_path / "run"), "--training.steps", str(K),
            "--checkpoint.enable", "true", "--checkpoint.interval", str(K),
            "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", str(K),
            "--checkpoint.last_save_model_only", "false",
            "--checkpoint.local_root", str(tmp_path / "nvme" / "{job}" / "node-{node}"),
            "--checkpoint.job_id", "reshard"]


def _script() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve())]


def _train(tmp_path: Path, world: int, ranks_per_node: int) -> list[dict]:
    """Phase 1: ``world`` ranks (``ranks_per_node`` per simulated node, 2 replicas) train K
    steps into ``tmp_path``; returns each rank's result."""
    ld = _launcher()
    try:
        ld.Job("train", world=world, log_dir=str(tmp_path / "logs"),
               cmd=[*_script(), "--mode", "train", "--result", str(tmp_path / "train.json"), *_common(tmp_path),
                    "--checkpoint.simulated_ranks_per_node", str(ranks_per_node),
                    "--checkpoint.replication_factor", "2"]).wait(600)
    except ld.DemoError as e:
        pytest.fail(str(e))
    finally:
        ld.kill_live_jobs()
    return [json.loads((tmp_path / f"train.json.rank{r}").read_text()) for r in range(world)]


def _skip_on_accelerator():
    from tierckpt.integration import accelerator_present

    if accelerator_present():
        pytest.skip("runs the CPU demo config (gloo, simulated nodes); the CPU patches are never applied on an accelerator machine")


@pytest.fixture(scope="module")
def trained_2x1(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-node × 1-rank training (phase 1), shared by the tests that restore it on another
    layout: each copies its dump folder and node-local roots (:func:`_copy_trained`) and
    restores, deletes and records in its own copy only."""
    _skip_on_accelerator()
    src = tmp_path_factory.mktemp("reshard-2x1")
    return src, _train(src, 2, 1)


def _copy_trained(trained: tuple[Path, list[dict]], tmp_path: Path) -> list[dict]:
    src, results = trained
    for d in ("run", "nvme"):
        shutil.copytree(src / d, tmp_path / d)
    return results


def test_resume_2_to_1_ranks_resharded_in_cluster_then_persistent(tmp_path, trained_2x1):
    ld = _launcher()
    dump, logs = tmp_path / "run", tmp_path / "logs"
    r2 = _copy_trained(trained_2x1, tmp_path)
    try:
        restore = [*_script(), "--mode", "restore", *_common(tmp_path), "--checkpoint.simulated_ranks_per_node", "1",
                   "--checkpoint.replication_factor", "1"]
        ld.Job("restore-1rank-in-cluster", world=1, log_dir=str(logs), restart_count=1,
               cmd=[*restore, "--result", str(tmp_path / "restore.json")]).wait(300)
        # node 1's shards now exist only in the persistent tier
        shutil.rmtree(tmp_path / "nvme" / "reshard" / "node-0" / "replicas" / "node-1")
        ld.Job("restore-1rank-persistent", world=1, log_dir=str(logs), restart_count=2,
               cmd=[*restore, "--result", str(tmp_path / "restore-pfs.json")]).wait(300)
    except ld.DemoError as e:
        pytest.fail(str(e))
    finally:
        ld.kill_live_jobs()

    r1 = json.loads((tmp_path / "restore.json.rank0").read_text())
    rp = json.loads((tmp_path / "restore-pfs.json.rank0").read_text())
    assert [r["world"] for r in r2] == [2, 2] and r1["world"] == rp["world"] == 1
    # The 2-rank value: the same full batch on both ranks, the same model → the same loss.
    assert r2[0]["loss_hex"] == r2[1]["loss_hex"], r2
    assert r2[0]["step"] == r1["step"] == rp["step"] == K

    ledger = _read_jsonl(dump / "checkpoint" / "tierckpt-ledger.jsonl")
    saves = {(r["tier"], r["step"]): r for r in ledger if r["kind"] == "checkpoint"}
    assert saves[("local", K)]["ok"] and saves[("persistent", K)]["ok"], saves
    starts = [r for r in ledger if r["kind"] == "run_start"]
    assert [s["world_size"] for s in starts] == [2, 1, 1]
    restores = [r for r in ledger if r["kind"] == "restore"]
    assert len(restores) == 2, restores
    cluster, pfs = restores
    # node 0's own copy and its replica of node 1 hold every chunk: no persistent byte is read
    assert cluster["step"] == K and cluster["sources"]["0"]["source"] == "in-cluster", cluster
    assert cluster["persistent_bytes"] == 0
    assert cluster["resharded"] == {"from": {"nodes": 2, "world_size": 2}, "to": {"nodes": 1, "world_size": 1}}
    assert r1["restored_from"] == {"0": "in-cluster"}
    # without the replica, node 1's shards are missing in-cluster: persistent, and the ledger names them
    assert pfs["sources"]["0"]["source"] == "persistent" and pfs["persistent_bytes"] > 0, pfs
    assert pfs["missing"] and any(f["source"] == "in-cluster" and f["step"] == K for f in pfs["failures"]), pfs
    assert rp["restored_from"] == {"0": "persistent"}
    # the data goes on where both ranks stopped: the rows neither had read, in order
    d2, d1 = [r["dataloader"] for r in r2], r1["dataloader"]
    assert d1["outcome"] == "resharded 2->1" and d1["epoch"] == 0 and d1["sample_idx"] == 0, d1
    n = sum(d["shard_len"] for d in d2)
    rest = [[0 + d2[0]["sample_idx"], d2[0]["shard_len"]], [d2[0]["shard_len"] + d2[1]["sample_idx"], n]]
    assert d1["view"] == rest and d1["buffer"] == sum(d["buffer"] for d in d2), (d1, d2)
    assert rp["dataloader"] == d1, (rp["dataloader"], d1)  # the same positions from either source

    l2, l1 = r2[0]["loss"], r1["loss"]
    assert math.isfinite(l1) and math.isfinite(l2)
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6), (l1, l2)
    # both sources hold the same values: the same 1-rank computation gives the same bits
    assert r1["loss_hex"] == rp["loss_hex"], (r1, rp)
    # and the restore is what made them equal: the freshly initialised model is far off
    assert abs(r1["loss_before_load"] - l2) > 0.1, r1


# the 4-rank case is slow on 2 cores; a data-parallel degree change resharded in-cluster is also
# test_resume_2_to_1_… (torchtitan) and tests/mcore/test_mcore_pp.py (Megatron)
@pytest.mark.parametrize("before,after", [((2, 1), (3, 1)),
                                          pytest.param((4, 2), (2, 1), marks=pytest.mark.slow)],
                         ids=["2-to-3-nodes", "2x2-to-2x1-ranks-dp4-to-dp2"])
def test_resume_in_cluster_on_more_nodes_or_fewer_ranks_per_node(tmp_path, before, after, request):
    """torchtitan FSDP2: 2 nodes → 3 nodes (a new empty node), and 2 nodes × 2 ranks → 2 nodes ×
    1 rank (data_parallel_shard_degree 4 → 2): restored in-cluster without a persistent byte, the
    dataloader repositioned, and the fixed-batch loss equal to the saved run's."""
    _skip_on_accelerator()
    (w0, rpn0), (w1, rpn1) = before, after
    dump = tmp_path / "run"
    if (w0, rpn0) == (2, 1):  # the training test_resume_2_to_1_… restores too
        trained = _copy_trained(request.getfixturevalue("trained_2x1"), tmp_path)
    else:
        trained = _train(tmp_path, w0, rpn0)
    ld = _launcher()
    try:
        ld.Job("restore", world=w1, log_dir=str(tmp_path / "logs"), restart_count=1,
               cmd=[*_script(), "--mode", "restore", "--result", str(tmp_path / "restore.json"), *_common(tmp_path),
                    "--checkpoint.simulated_ranks_per_node", str(rpn1), "--checkpoint.replication_factor", "1"]
               ).wait(600)
    except ld.DemoError as e:
        pytest.fail(str(e))
    finally:
        ld.kill_live_jobs()
    restored = [json.loads((tmp_path / f"restore.json.rank{r}").read_text()) for r in range(w1)]
    rec = [r for r in _read_jsonl(dump / "checkpoint" / "tierckpt-ledger.jsonl") if r["kind"] == "restore"][-1]
    assert rec["step"] == K and {v["source"] for v in rec["sources"].values()} == {"in-cluster"}, rec
    assert rec["persistent_bytes"] == 0 and len(rec["sources"]) == w1 // rpn1
    assert rec["resharded"] == {"from": {"nodes": w0 // rpn0, "world_size": w0},
                                "to": {"nodes": w1 // rpn1, "world_size": w1}}
    assert all(r["dataloader"]["outcome"] == f"resharded {w0}->{w1}" for r in restored), restored
    # every new rank reads rows no old rank had read, and no two new ranks the same rows
    views = [tuple(map(tuple, r["dataloader"]["view"])) for r in restored]
    assert len(set(views)) == w1, views
    saved = trained[0]["loss"]
    for r in restored:
        assert r["step"] == K and r["loss"] == pytest.approx(saved, rel=1e-5, abs=1e-6), (r, saved)
