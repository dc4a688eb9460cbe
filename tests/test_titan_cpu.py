"""torchtitan on CPU: demo assets, CPU compatibility patches, a real 2-rank training run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def test_assets_deterministic_and_cached(tmp_path):
    from tierckpt_dev.titan.assets import VOCAB_SIZE, ensure_assets

    a = ensure_assets(tmp_path / "a")
    b = ensure_assets(tmp_path / "b")
    assert a.assets_hash == b.assets_hash
    for rel in ("corpus.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                "manifest.json"):
        assert (a.root / rel).read_bytes() == (b.root / rel).read_bytes(), rel
    assert a.vocab_size <= VOCAB_SIZE and a.num_documents > 1000

    # Reused when present: nothing is rewritten.
    mtime = (a.root / "tokenizer/tokenizer.json").stat().st_mtime_ns
    assert ensure_assets(a.root).assets_hash == a.assets_hash
    assert (a.root / "tokenizer/tokenizer.json").stat().st_mtime_ns == mtime

    # A damaged cache is detected and rebuilt to the same bytes.
    with open(a.root / "corpus.jsonl", "ab") as f:
        f.write(b'{"source": "x", "text": "garbage"}\n')
    assert ensure_assets(a.root).assets_hash == a.assets_hash
    assert (a.root / "corpus.jsonl").read_bytes() == (b.root / "corpus.jsonl").read_bytes()

    # torchtitan's own tokenizer loader reads it, with bos/eos, inside the model's vocab.
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(tokenizer_path=str(a.tokenizer_dir))
    ids = tok.encode("Return the sum of the values.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < VOCAB_SIZE
    assert tok.decode(ids[1:-1]) == "Return the sum of the values."

    from tierckpt_dev.titan.assets import load_corpus_dataset

    ds = load_corpus_dataset(str(a.corpus))
    assert len(ds) == a.num_documents and isinstance(ds[0]["text"], str)


def test_cpu_compat_noop_with_accelerator_and_idempotent():
    # Fresh interpreter: patches are process-global.
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        import torchtitan.tools.utils as tu
        from tierckpt_dev.titan import cpu

        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True          # pretend a GPU is present
        assert cpu.accelerator_present()
        before = (tu.device_type, tu.device_module, hasattr(dist, "set_timeout"))
        assert cpu.apply_cpu_compat() == []
        assert (tu.device_type, tu.device_module, hasattr(dist, "set_timeout")) == before
        assert cpu.applied_patches() == []

        torch.cuda.is_available = real
        if cpu.accelerator_present():
            print("SKIP accelerator present")
            raise SystemExit(0)
        first = cpu.apply_cpu_compat()
        assert first == cpu.patch_names(), first
        assert cpu.apply_cpu_compat() == []             # second call does nothing
        assert tu.device_type == "cpu" and tu.device_module.current_device() == 0
        import torchtitan.distributed.utils as du, torchtitan.components.metrics as m
        assert du.device_type == "cpu" and m.device_module is tu.device_module
        assert hasattr(dist, "set_timeout")
        import torchtitan.models.common.attention as attention
        from torch.nn.attention.flex_attention import create_block_mask as eager_block_mask
        assert attention._compiled_create_block_mask is eager_block_mask  # no torch.compile per launch

        # Eager flex attention on CPU now has a backward, and it is the right one.
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
        bm = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 128, 128, device="cpu")
        out = flex_attention(q, k, v, block_mask=bm)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g1 = torch.autograd.grad(out.sum(), q)[0]
        g2 = torch.autograd.grad(ref.sum(), q)[0]
        assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(g1, g2, atol=1e-5)
        print("OK", first)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    if "SKIP" in r.stdout:
        pytest.skip("an accelerator is present: the CPU patches are (correctly) not applied, nothing to check")
    assert "OK" in r.stdout


def test_patches_documented():
    from tierckpt_dev.titan import cpu

    names = cpu.patch_names()
    assert len(names) == len(set(names)) >= 4
    for _, fn in cpu._PATCHES:
        doc = fn.__doc__ or ""
        assert "Breaks without it" in doc and "Safe" in doc, fn.__name__


def test_two_rank_training(tmp_path):
    """Real torchtitan run: llama3 debugmodel, FSDP2 over 2 gloo ranks, our corpus/tokenizer
    (built concurrently by both ranks into a fresh directory), 3 steps."""
    from tierckpt.integration import accelerator_present

    if accelerator_present():
        pytest.skip("checks the CPU patches, which are never applied on an accelerator machine")
    dump = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "torchtitan.train", "--module", "tierckpt_dev.titan", "--config", "titan_demo",
        "--training.steps", "3", "--dump_folder", str(dump),
    ]
    r = subprocess.run(cmd, cwd=REPO, env=_env(TIERCKPT_ASSETS_DIR=str(tmp_path / "assets")),
                       capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    assert log.count("applied CPU compatibility patch fsdp_gloo_sum_reduction") == 2

    from titan_plugin.metrics import read_losses, read_records

    recs = read_records(dump / "metrics" / "losses.jsonl")
    assert [x["step"] for x in recs] == [1, 2, 3]
    losses = read_losses(dump / "metrics" / "losses.jsonl")
    assert all(math.isfinite(v) for v in losses.values())
    assert 6.0 < losses[1] < 9.5, losses  # ~ln(2048)=7.6 at init
    assert losses[3] < losses[1], losses
    # The log's 5-decimal values agree with the exact ones.
    assert f"loss: {losses[3]:8.5f}" in log
    manifest = json.loads((tmp_path / "assets" / "manifest.json").read_text())
    assert manifest["vocab_size"] <= 2048
