"""Config functions for torchtitan's ``--module tierckpt_dev.titan --config <fn>``.

torchtitan 0.3.0's ``ConfigManager`` resolves a third-party ``--module pkg`` by importing
``pkg.config_registry`` and calling the function named by ``--config``; CLI flags
(``--training.steps 5``, ``--checkpoint.enable`` …) are then applied on top by tyro.

``titan_demo``: the llama3 debug model on the demo corpus (``tierckpt_dev.titan.assets``), sized for a
2-core CPU machine: seq 256 × local batch 2, 30 steps, fp32 params, no compile, no activation
checkpointing, no validator, fixed seed, deterministic algorithms, loss logged every step.
Checkpointing is tierckpt's ``TieredCheckpointManager.Config`` (off by default; enable it from
the CLI with ``--checkpoint.enable`` or use configs/titan_demo.toml).

Run: ``python -m torch.distributed.run --nproc-per-node 2 -m torchtitan.train
--module tierckpt_dev.titan --config titan_demo``.
"""

from __future__ import annotations

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer import default_adamw as _default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size as _decoder_vocab_size
from torchtitan.models.llama3 import model_registry as _model_registry
from torchtitan.trainer import Trainer

from tierckpt_dev.titan.assets import DATASET_NAME
from tierckpt_dev.titan.assets import ensure_assets as _ensure_assets
from tierckpt_dev.titan.assets import register_dataset as _register_dataset
from tierckpt_dev.titan.cpu import apply_cpu_compat as _apply_cpu_compat
from titan_plugin.manager import TieredCheckpointManager
from titan_plugin.metrics import JsonlMetricsProcessor

__all__ = ["titan_demo", "DEMO_SEED"]
# Helpers are imported under private names: ConfigManager lists every public lowercase callable
# of this module as an available --config.

DEMO_SEED = 42

# Register the demo dataset name at import time: ConfigManager imports this module in every
# rank process before the trainer (and its dataloader) is built.
_register_dataset()


def titan_demo() -> Trainer.Config:
    """llama3 debugmodel on the stdlib-docstring corpus; CPU friendly, deterministic."""
    _apply_cpu_compat()  # no-op when an accelerator is present or already applied
    assets = _ensure_assets()  # builds once (file-locked), then reuses the cached build
    _register_dataset(assets.corpus)

    # FlexAttention with block-causal (per-document) masks; on CPU it runs eagerly (cpu.py).
    model_spec = _model_registry("debugmodel", attn_backend="flex")
    vocab_size = _decoder_vocab_size(model_spec)
    if assets.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer vocab {assets.vocab_size} exceeds the model's vocab_size {vocab_size}"
        )

    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=str(assets.tokenizer_dir),
        dump_folder="./outputs/titan_demo",
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size),
        ),
        optimizer=_default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2,
            decay_ratio=0.8,
            decay_type="linear",
            min_lr_factor=0.0,
        ),
        training=TrainingConfig(
            local_batch_size=2,
            seq_len=256,
            steps=30,
            # bf16 matmuls are ~6x slower than fp32 on these CPUs; keep everything fp32.
            mixed_precision_param="float32",
            # CUDA graphs: nothing to capture without CUDA (the trainer would only warn).
            disable_cuda_graphs=True,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset=DATASET_NAME,
            dataset_path=str(assets.corpus),
            infinite=True,
        ),
        # Exact per-step losses in <dump_folder>/metrics/losses.jsonl (titan_plugin.metrics).
        metrics=JsonlMetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        parallelism=ParallelismConfig(
            # FSDP2 only; model-parallel axes (none here) would use DTensor. The default
            # "spmd_types" backend is not what the multi-rank CPU runs were verified with.
            spmd_backend="partial_dtensor",
        ),
        # Tiered checkpoints (off until enabled: --checkpoint.enable or configs/titan_demo.toml):
        # local tier + replica every 5 steps, persistent tier every 10, 2 simulated nodes.
        checkpoint=TieredCheckpointManager.Config(
            enable=False,
            folder="checkpoint",
            interval=10,
            last_save_model_only=False,
            local_interval=5,
            local_root="./outputs/titan_demo/nvme/{job}/node-{node}",
            replication_factor=2,
            simulated_ranks_per_node=1,
            job_id="titan-demo",
        ),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
        comm=CommConfig(
            # gloo on 2 cores: the first steps (eager flex attention warm-up, DCP) can be slow.
            init_timeout_seconds=600,
            train_timeout_seconds=600,
        ),
        debug=DebugConfig(seed=DEMO_SEED, deterministic=True),
    )
