"""Tiny Megatron-Core GPT (local layer spec) + DistributedOptimizer on CPU/gloo, for the
mcore_plugin tests. Rank functions use these helpers inside ``tests.harness.run_world``."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist

VOCAB, HIDDEN, HEADS, LAYERS, FFN, SEQ, MBS = 64, 16, 4, 2, 40, 16, 2


def setup(tp: int = 1, seed: int = 1234, pp: int = 1):
    """Apply the CPU shims and the Adam-step fix, then (re)initialise Megatron's parallel
    state with tensor parallel size ``tp`` and pipeline parallel size ``pp``
    (DP = world / (tp × pp))."""
    import tierckpt_dev.mcore.cpu as cpu
    from mcore_plugin import optim_state
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu.apply()
    optim_state.install()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)


def build(seed: int = 0, lr: float = 1e-2, bucket_size: int | None = None):
    """GPTModel (2 layers, hidden 16, vocab 64; dropout off) wrapped in Megatron DDP, and
    ``get_megatron_optimizer`` (adam → torch AdamW fallback, distributed optimizer). Under
    pipeline parallelism (``setup(pp=…)``) each rank builds its stage only: the embedding on
    the first stage, the output layer and loss on the last, ``LAYERS / pp`` layers each.
    ``bucket_size``: DDP's grad-buffer bucket size in elements (None: one bucket, as Megatron
    makes without ``overlap_grad_reduce``; set, it turns ``overlap_grad_reduce`` on)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(), params_dtype=torch.float32,
        pipeline_model_parallel_size=(pp := ps.get_pipeline_model_parallel_world_size()),
        pipeline_dtype=torch.float32 if pp > 1 else None,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    # Megatron makes one bucket without overlap_grad_reduce, whatever bucket_size says
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=bucket_size,
                                        overlap_grad_reduce=bucket_size is not None)
    model = DDP(cfg, ddp, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=True),
        [model])
    return model, opt


def batch(step: int, dp_rank: int, dp_size: int):
    """Tokens of ``step`` for one DP rank: the global batch (MBS × 2 sequences) split by DP."""
    g = torch.Generator().manual_seed(7919 * step + 1)
    tok = torch.randint(0, VOCAB, (MBS * 2, SEQ + 1), generator=g)
    per = tok.shape[0] // dp_size
    tok = tok[dp_rank * per:(dp_rank + 1) * per]
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def _forward(model, tokens, labels):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    n = tokens.shape[1]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1).view(1, 1, n, n)
    return model(tokens, pos, mask, labels=labels)


def train_step(model, opt, step: int) -> float:
    """One optimizer step on ``batch(step, …)``; returns the global mean loss (all ranks)."""
    from megatron.core import parallel_state as ps

    dp, dps = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens, labels = batch(step, dp, dps)
    model.train()
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = _forward(model, tokens, labels).mean()
    loss.backward()
    model.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    t = loss.detach().clone()
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return (t / dps).item()


def fixed_batch_loss(model) -> float:
    """Mean loss of the model on one fixed batch (the same on every rank and topology)."""
    g = torch.Generator().manual_seed(424242)
    tok = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    model.eval()
    with torch.no_grad():
        loss = _forward(model, tok[:, :-1].contiguous(), tok[:, 1:].contiguous()).mean()
    return float(loss)


def state_dict_fn(model, opt, iteration: int, *, rng: bool = True):
    """Megatron-LM-style state dict builder: ``fn(distrib_optim_sharding_type, is_loading)``.
    Holds model, optimizer (in the requested format), iteration, args, a scheduler entry and,
    when ``rng``, this rank's RNG states as a per-rank ShardedObject (like Megatron-LM's
    ``rng_state``; left out when loading under another world size, like ``--no-load-rng``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng_state = rng_payload()

    def fn(fmt: str, is_loading: bool) -> dict:
        sd = common_of(iteration)
        sd["model"] = model.module.sharded_state_dict()  # Megatron-LM unwraps DDP first
        sd["optimizer"] = opt.sharded_state_dict(sd["model"], is_loading=is_loading,
                                                 metadata={"distrib_optim_sharding_type": fmt})
        if rng:
            r, w = dist.get_rank(), dist.get_world_size()
            sd["rng_state"] = ShardedObject("rng_state", rng_state, (w,), (r,), replica_id=0)
        return sd

    return fn


def rng_payload() -> dict:
    """This rank's RNG entry as saved by :func:`state_dict_fn` (taken when the fn is built)."""
    return {"torch": torch.get_rng_state(), "rank": dist.get_rank()}


def common_of(iteration: int) -> dict:
    """The common (non-sharded) values :func:`state_dict_fn` saves at ``iteration``."""
    return {"iteration": iteration, "checkpoint_version": 3.0,
            "args": SimpleNamespace(tensor_model_parallel_size=1, seed=1234, lr=1e-2),
            "opt_param_scheduler": {"num_steps": iteration * MBS * 2, "max_lr": 1e-2}}


def apply_loaded(model, opt, sd: dict) -> None:
    """What Megatron-LM's load_checkpoint does with a loaded state dict (under no_grad: with
    fp32 parameters the distributed optimizer's main params are views of them)."""
    with torch.no_grad():
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])


def inner_optimizers(opt):
    return list(getattr(opt, "chained_optimizers", [opt]))


def snapshot(model, opt) -> dict:
    """Bitwise copy of this rank's parameters and optimizer state: main (fp32) params,
    exp_avg, exp_avg_sq and each parameter's own ``step`` (keyed by model param name)."""
    out = {"model": {n: p.detach().clone() for n, p in model.module.named_parameters()}}
    from mcore_plugin import optim_state

    names = {p: n for n, p in model.module.named_parameters()}
    optim = {}
    for i, o in enumerate(inner_optimizers(opt)):
        for p in optim_state.local_params(o):
            gi, go = o.model_param_group_index_map[p]
            main = o.optimizer.param_groups[gi]["params"][go]
            st = o.optimizer.state[main]
            optim[f"{i}.{names[p]}"] = {"main": main.detach().clone(),
                                         **{k: v.detach().clone() for k, v in st.items()}}
        optim[f"{i}.groups"] = [{k: v for k, v in g.items() if k != "params"} for g in o.optimizer.param_groups]
    out["optim"] = optim
    return out


def step_tensors_distinct(opt) -> bool:
    """Every parameter owns its step tensor (no aliasing across parameters)."""
    for o in inner_optimizers(opt):
        steps = [s["step"] for s in o.optimizer.state.values() if "step" in s]
        if len({id(s) for s in steps}) != len(steps):
            return False
    return True


def wipe(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def train_step_pp(model, opt, step: int) -> float:
    """One optimizer step on ``batch(step, …)`` through Megatron's pipeline schedule (1F1B,
    one microbatch per DP rank); returns the global mean loss on every rank (the last stage
    computes it, a broadcast over the pipeline group shares it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dps = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens, labels = batch(step, dp, dps)

    def forward_step(data_iterator, m):
        tok, lab = next(data_iterator)
        pos = torch.arange(tok.shape[1]).unsqueeze(0).expand_as(tok)
        n = tok.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1).view(1, 1, n, n)
        out = m(tok, pos, mask, labels=lab)
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    model.train()
    model.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([(tokens, labels)]), model=[model],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=tokens.shape[0], forward_only=False)
    ok, _, _ = opt.step()
    assert ok
    t = torch.zeros(1)
    if ps.is_pipeline_last_stage():
        t[0] = losses[0]["loss"]
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        t /= dps
    last = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast(t, src=last, group=ps.get_pipeline_model_parallel_group())
    return t.item()


def global_optimizer_state(model, opt) -> dict:
    """The distributed optimizer's state in model space, gathered over the DP group:
    ``{param name: {"main" | "exp_avg" | "exp_avg_sq": flat fp32 tensor of the parameter's
    numel, "step": float}}`` — the same values under any DP size (collective over DP)."""
    from megatron.core import parallel_state as ps

    from mcore_plugin import optim_state

    names = {p: n for n, p in model.module.named_parameters()}
    mine = []
    for o in inner_optimizers(opt):
        for p in optim_state.local_params(o):
            r = o._get_model_param_range_map(p)["param"]
            gi, go = o.model_param_group_index_map[p]
            main = o.optimizer.param_groups[gi]["params"][go]
            st = o.optimizer.state[main]
            mine.append((names[p], p.numel(), r.start, r.end, main.detach().clone(),
                         st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"])))
    parts = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(parts, mine, group=ps.get_data_parallel_group())
    out: dict = {}
    for name, numel, start, end, main, m1, m2, step in (x for part in parts for x in part):
        e = out.setdefault(name, {k: torch.full((numel,), float("nan")) for k in ("main", "exp_avg", "exp_avg_sq")})
        for k, v in (("main", main), ("exp_avg", m1), ("exp_avg_sq", m2)):
            e[k][start:end] = v
        assert e.setdefault("step", step) == step, f"{name}: steps differ across DP ranks"
    for name, e in out.items():
        for k in ("main", "exp_avg", "exp_avg_sq"):
            assert not e[k].isnan().any(), f"{name}.{k}: not covered by the DP ranks"
    return out
