"""Export a ``dp_reshardable`` torch_dist checkpoint as a ``fully_reshardable`` one.

``dp_reshardable`` (Megatron's default distributed-optimizer format) stores the optimizer
state as the DistributedOptimizer's flat grad-buffer buckets, one set per model-parallel
(TP×PP) rank: it reloads only with the same TP/PP. ``fully_reshardable`` stores it in model
space (``optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>``, each shaped and sharded
like the parameter), which any TP/PP/DP can load.

The conversion needs no model code and no process group: the buckets' layout is rebuilt
from the checkpoint itself and checked against the sizes Megatron recorded:

1. model parameters and their chunks come from the DCP metadata (one key per parameter,
   in module order; stacked layers share a key with a leading layer axis);
2. per model-parallel rank (``dp_group_idx`` = tp_rank + TP·pp_rank, Megatron's default
   rank order), its parameters in module order, reversed (``_ParamAndGradBuffer`` fills the
   buffer in backward order), each start padded to a multiple of 64 elements (the
   distributed optimizer's alignment, megatron/core/distributed/param_and_grad_buffer.py);
3. buckets close exactly where ``per_bucket_numel_unpadded`` (saved in the checkpoint) says;
   TP/PP come from the ``args`` in ``common.pt`` when present, else every factorisation of
   the number of model-parallel ranks is tried. A layout that does not reproduce every
   bucket size exactly, or leaves an element uncovered, aborts the export (nothing written).

Everything else (model tensors, RNG and other objects, the per-parameter Adam steps of
:mod:`mcore_plugin.optim_state`) is copied unchanged; ``common.pt`` gets
``param_state_sharding_type = "fully_reshardable"`` and the optimizer's param groups, as
Megatron's own ``fully_reshardable`` save writes them.

Limits: one DistributedOptimizer (no ChainedOptimizer of several), no expert-parallel
buffers, uniform pipeline stages, regular TP chunks (no SwiGLU-fused ``linear_fc1``, whose
chunks are not contiguous per rank). Each is detected and reported. The whole checkpoint is
held in host memory (bytes ≈ checkpoint size).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

log = logging.getLogger(__name__)

_BUCKET_RE = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")
_GROUP_OBJ_RE = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/shard_[\d_.]+$")
PARAM_ALIGN = 64  # DistributedOptimizer: params start at multiples of 64 elements


class ExportError(ValueError):
    """The source cannot be exported (names the reason); nothing was written."""


@dataclass
class ExportReport:
    """What :func:`export` did.

    Attributes:
        src, dst: directories.
        tp, pp: model parallelism of the source (inferred or from ``args``).
        params: model parameters mapped into the optimizer buckets (per model-parallel rank).
        tensors: tensors written; objects: ShardedObjects copied.
        bytes_written: bytes of the files under ``dst``.
    """

    src: str
    dst: str
    tp: int = 0
    pp: int = 0
    params: int = 0
    tensors: int = 0
    objects: int = 0
    bytes_written: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class _Param:
    key: str
    layer: int | None
    offsets: tuple  # chunk offsets in the model key's global shape (layer axis included)
    sizes: tuple


def _common(src: str) -> dict:
    p = os.path.join(src, "common.pt")
    if os.path.exists(p):
        return torch.load(p, weights_only=False, map_location="cpu")
    from megatron.core.dist_checkpointing.mapping import ShardedObject  # 0.19: inside DCP

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    sd = {key: io.BytesIO()}
    dcp.load(sd, storage_reader=FileSystemReader(src), no_dist=True)
    v = sd[key]
    if isinstance(v, io.BytesIO):
        v.seek(0)
        v = torch.load(v, weights_only=False)
    return v[0]


def _find_optimizer_common(common: dict) -> dict:
    stack = [common]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            if isinstance(d.get("param_state_sharding_type"), str):
                return d
            stack.extend(d.values())
    raise ExportError("no distributed-optimizer state in common.pt (param_state_sharding_type missing)")


def _is_model_key(k: str) -> bool:
    return not (k.startswith("optimizer.") or k.startswith("chained_") or k == "rng_state"
                or "/" in k)


def _layered(k: str, md: TensorStorageMetadata) -> bool:
    return ".layers." in k and len(md.size) >= 2 and all(c.sizes[0] == 1 for c in md.chunks)


def _model_params(md, tp: int, pp: int) -> dict[int, list[_Param]]:
    """{model-parallel rank: its parameters in module order} (see module docstring)."""
    keys = [(k, v) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and _is_model_key(k)]
    layered = [(k, v) for k, v in keys if _layered(k, v)]
    if layered:
        first = next(i for i, (k, v) in enumerate(keys) if _layered(k, v))
        last = max(i for i, (k, v) in enumerate(keys) if _layered(k, v))
    else:
        first = last = len(keys)
    pre = [kv for kv in keys[:first] if not _layered(*kv)]
    post = [kv for kv in keys[last + 1:] if not _layered(*kv)]
    n_layers = {int(v.size[0]) for _, v in layered}
    if len(n_layers) > 1:
        raise ExportError(f"layer-stacked keys disagree on the layer count: {sorted(n_layers)}")
    L = n_layers.pop() if n_layers else 0
    if L % pp:
        raise ExportError(f"{L} layers do not split evenly over {pp} pipeline stages")

    def tp_chunk(k, v, layer, tp_rank):
        chunks = [c for c in v.chunks if layer is None or c.offsets[0] == layer]
        rest = sorted({tuple(c.offsets[1 if layer is not None else 0:]) for c in chunks})
        if len(rest) == 1:
            pick = rest[0]
        elif len(rest) == tp:
            pick = rest[tp_rank]
        else:
            raise ExportError(f"{k}: {len(rest)} chunks per layer for TP={tp} (irregular sharding, "
                              "e.g. fused SwiGLU, is not supported)")
        c = next(c for c in chunks if tuple(c.offsets[1 if layer is not None else 0:]) == pick)
        return _Param(k, layer, tuple(c.offsets), tuple(c.sizes))

    out = {}
    per = L // pp if pp else 0
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            plist = []
            if pp_rank == 0:
                plist += [tp_chunk(k, v, None, tp_rank) for k, v in pre]
            for layer in range(pp_rank * per, (pp_rank + 1) * per):
                plist += [tp_chunk(k, v, layer, tp_rank) for k, v in layered]
            if pp_rank == pp - 1:
                plist += [tp_chunk(k, v, None, tp_rank) for k, v in post]
            out[tp_rank + tp * pp_rank] = plist
    return out


def _layout(params: list[_Param], unpadded: list[int]) -> list[tuple[_Param, int, int, int]] | None:
    """[(param, bucket, start, end)] reproducing ``unpadded`` bucket sizes, or None."""
    out, bucket, start = [], 0, 0
    for p in reversed(params):
        if bucket >= len(unpadded):
            return None
        n = math.prod(p.sizes)
        start = int(math.ceil(start / PARAM_ALIGN) * PARAM_ALIGN)
        end = start + n
        if end > unpadded[bucket]:
            return None
        out.append((p, bucket, start, end))
        if end == unpadded[bucket]:
            bucket, start = bucket + 1, 0
        else:
            start = end
    return out if bucket == len(unpadded) and start == 0 else None


def _parallel_candidates(common: dict, groups: int) -> list[tuple[int, int]]:
    args = common.get("args")
    tp = getattr(args, "tensor_model_parallel_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    cands = []
    if isinstance(tp, int) and isinstance(pp, int) and tp * pp == groups:
        cands.append((tp, pp))
    for t in range(1, groups + 1):
        if groups % t == 0 and (t, groups // t) not in cands:
            cands.append((t, groups // t))
    return cands


def _check_tierckpt_commit(src: str) -> None:
    """A step written by tierckpt (manifest or in-progress marker present) must be committed and
    intact: a torn or half-written ``step-N`` is never exported.

    Raises:
        ExportError: not committed, or a file's size/xxh3 differs from the manifest.
    """
    from tierckpt.io import manifest
    from tierckpt.io.layout import INPROGRESS, MANIFEST
    from tierckpt.io.storage import Store

    if not any(os.path.exists(os.path.join(src, n)) for n in (MANIFEST, INPROGRESS)):
        return  # a plain Megatron checkpoint: nothing of ours to check
    parent, name = os.path.split(src.rstrip(os.sep))
    store = Store(parent)
    doc = manifest.read_committed(store, name)
    if doc is None:
        raise ExportError(f"{src}: a tierckpt step that is not committed (torn or still being written)")
    problems = manifest.verify_files(store, name, manifest.entries_of(doc))
    if problems:
        raise ExportError(f"{src}: fails verification: {'; '.join(problems[:3])}")


def export(src: str, dst: str, *, overwrite: bool = False,
           progress: Callable[[str, int, int], None] | None = None) -> ExportReport:
    """Write ``dst``, the ``fully_reshardable`` version of the ``dp_reshardable`` torch_dist
    checkpoint ``src`` (single process, no process group; see the module docstring).

    Args:
        src: torch_dist checkpoint directory (``metadata.json``, ``.metadata``, ``*.distcp``).
        dst: output directory (must not exist unless ``overwrite``).
        overwrite: replace an existing ``dst``.
        progress: ``progress(phase, done, total)`` callback (phases: read, convert, write).

    Returns:
        :class:`ExportReport`.
    Raises:
        ExportError: not a torch_dist checkpoint, not ``dp_reshardable``, a layout that cannot
            be rebuilt exactly, or ``dst`` exists.
    """
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    rep = ExportReport(src=src, dst=dst)
    prog = progress or (lambda *a: None)
    _check_source(src, dst, overwrite)
    common = _common(src)
    ocommon = _find_optimizer_common(common)
    fmt = ocommon["param_state_sharding_type"]
    if fmt != "dp_reshardable":
        raise ExportError(f"{src}: the optimizer is stored as {fmt!r}, not 'dp_reshardable'")
    md = FileSystemReader(src).read_metadata()
    if any(k.startswith("chained_") for k in md.state_dict_metadata):
        raise ExportError("several chained optimizers (keys 'chained_<i>.…') are not supported")
    items, sd = _read_all(src, md, prog)
    buckets, group_objs = _buckets_of(items, sd)
    layouts = _find_layouts(md, common, buckets, group_objs, rep)
    pyt = _unchanged(items, sd, rep)
    pyt.update(_to_model_space(md, layouts, buckets, rep, prog))
    rep.tensors = sum(1 for x in pyt.values() if isinstance(x, torch.Tensor))
    for name, val in group_objs.get(0, {}).items():
        if name not in ("per_bucket_numel", "per_bucket_numel_unpadded"):
            ocommon[name] = val
    ocommon["param_state_sharding_type"] = "fully_reshardable"
    _write(dst, pyt, common, prog)
    rep.bytes_written = sum(f.stat().st_size for f in Path(dst).iterdir() if f.is_file())
    return rep


def _check_source(src: str, dst: str, overwrite: bool) -> None:
    """``src`` is a torch_dist checkpoint (a committed, intact one if tierckpt wrote it) and
    ``dst`` may be written. Raises ExportError otherwise."""
    cfg = os.path.join(src, "metadata.json")
    if not os.path.exists(cfg):
        raise ExportError(f"{src}: not a Megatron distributed checkpoint (no metadata.json)")
    backend = json.loads(Path(cfg).read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise ExportError(f"{src}: sharded_backend is {backend!r}; only torch_dist is supported")
    if os.path.exists(dst) and not overwrite:
        raise ExportError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    if os.path.realpath(dst) == os.path.realpath(src):
        raise ExportError("SRC and DST are the same directory")
    _check_tierckpt_commit(src)


def _read_all(src: str, md, prog) -> tuple[list, dict]:
    """Every item of ``src``: tensors as full tensors, objects as loaded Python values.
    Returns ``(metadata items, {key: value})``."""
    items = list(md.state_dict_metadata.items())
    sd = {}
    for k, v in items:
        sd[k] = torch.empty(tuple(v.size), dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) \
            else io.BytesIO()
    prog("read", 0, len(items))
    dcp.load(sd, storage_reader=FileSystemReader(src), no_dist=True)
    prog("read", len(items), len(items))
    return items, sd


def _buckets_of(items: list, sd: dict) -> tuple[dict, dict]:
    """``(buckets, group objects)``: ``buckets[dp_group_idx][gbuf_idx][bucket_idx][state key]``
    (flat tensors) and ``{dp_group_idx: {name: value}}`` of the per-group objects.

    Raises:
        ExportError: no buckets, several grad buffers per rank, or gaps in the group indices.
    """
    buckets: dict[int, dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
    group_objs: dict[int, dict[str, object]] = {}
    for k, v in items:
        m = _BUCKET_RE.match(k)
        if m:
            g, gb, _, b, sk = int(m[1]), int(m[2]), m[3], int(m[4]), m[5]
            buckets.setdefault(g, {}).setdefault(gb, {}).setdefault(b, {})[sk] = sd[k]
            continue
        m = _GROUP_OBJ_RE.match(k)
        if m:
            val = sd[k]
            group_objs.setdefault(int(m[1]), {})[m[2]] = val[0] if isinstance(val, list) else val
    if not buckets:
        raise ExportError("no dp_reshardable optimizer buckets (optimizer.distributed.…) in the checkpoint")
    if any(len(gbs) != 1 for gbs in buckets.values()):
        raise ExportError("several grad buffers per rank (mixed parameter dtypes or expert-parallel "
                          "buffers) are not supported")
    groups = sorted(buckets)
    if groups != list(range(len(groups))):
        raise ExportError(f"unexpected model-parallel group indices {groups}")
    return buckets, group_objs


def _find_layouts(md, common: dict, buckets: dict, group_objs: dict, rep: ExportReport) -> dict:
    """``{dp_group_idx: [(param, bucket, start, end)]}`` of the first TP×PP that reproduces
    every group's bucket sizes (records TP/PP in ``rep``).

    Raises:
        ExportError: no candidate reproduces them, or a group's sizes are unreadable.
    """
    groups = sorted(buckets)
    errors = []
    for tp, pp in _parallel_candidates(common, len(groups)):
        try:
            per_rank = _model_params(md, tp, pp)
        except ExportError as e:
            errors.append(f"TP={tp} PP={pp}: {e}")
            continue
        got: dict[Any, list[tuple[_Param, int, int, int]]] = {}
        for g in groups:
            unp = group_objs.get(g, {}).get("per_bucket_numel_unpadded")
            try:  # per grad buffer: {(param dtype, grad dtype): [numel of each bucket]}
                sizes = list(unp[0].values())[0]
            except (IndexError, AttributeError, KeyError, TypeError):
                sizes = None
            if sizes is None:
                raise ExportError(f"dp_group_idx_{g}: per_bucket_numel_unpadded missing or unreadable")
            lay = _layout(per_rank[g], list(sizes))
            if lay is None:
                errors.append(f"TP={tp} PP={pp}: rank {g}'s parameters do not reproduce bucket sizes {sizes}")
                got = {}
                break
            got[g] = lay
        if got:
            rep.tp, rep.pp = tp, pp
            return got
    raise ExportError("cannot rebuild the optimizer bucket layout: " + "; ".join(errors))


def _to_model_space(md, layouts: dict, buckets: dict, rep: ExportReport, prog) -> dict[str, torch.Tensor]:
    """The optimizer state of the buckets as ``optimizer.state.<key>.<model key>`` tensors,
    each shaped like its parameter (counts parameters in ``rep``).

    Raises:
        ExportError: an element of some parameter's state is not covered by any bucket.
    """
    groups = sorted(layouts)
    state_keys = sorted({sk for g in groups for b in buckets[g][0].values() for sk in b})
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    total = sum(len(v) for v in layouts.values())
    done = 0
    for g in groups:
        for p, b, start, end in layouts[g]:
            tmd = md.state_dict_metadata[p.key]
            region = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))
            for sk in state_keys:
                src_t = buckets[g][0][b][sk]
                name = f"optimizer.state.{sk}.{p.key}"
                if name not in out:
                    out[name] = torch.zeros(tuple(tmd.size), dtype=src_t.dtype)
                    filled[name] = torch.zeros(tuple(tmd.size), dtype=torch.bool)
                if filled[name][region].all():
                    continue  # a TP/PP-replicated parameter: the first rank's copy is kept
                out[name][region] = src_t[start:end].reshape(p.sizes)
                filled[name][region] = True
            done += 1
            rep.params += 1
            prog("convert", done, total)
    holes = [n for n, f in filled.items() if not bool(f.all())]
    if holes:
        raise ExportError(f"optimizer state not covered by any bucket for {holes[:3]}")
    return out


def _unchanged(items: list, sd: dict, rep: ExportReport) -> dict:
    """Everything but the buckets and the common state, unchanged; objects re-serialised as
    torch_dist stores them (counts them in ``rep``)."""
    pyt: dict[str, object] = {}
    for k, v in items:
        if _BUCKET_RE.match(k) or _GROUP_OBJ_RE.match(k):
            continue
        if k.startswith("common_state/"):
            continue  # common.pt is written by _write
        if isinstance(v, TensorStorageMetadata):
            pyt[k] = sd[k]
        else:
            buf = io.BytesIO()
            torch.save(sd[k], buf)
            buf.seek(0)
            pyt[k] = buf
            rep.objects += 1
    return pyt


def _write(dst: str, pyt: dict, common: dict, prog) -> None:
    """The torch_dist checkpoint ``dst`` (DCP files, ``common.pt``, ``metadata.json``), written
    next to it first and renamed into place."""
    prog("write", 0, 1)
    tmp = dst + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    dcp.save(pyt, storage_writer=FileSystemWriter(tmp, sync_files=True),
             planner=MCoreSavePlanner(flatten_state_dict=False), no_dist=True)
    with open(os.path.join(tmp, "common.pt"), "wb") as f:
        torch.save(common, f)
        f.flush()
        os.fsync(f.fileno())
    save_config(CheckpointingConfig("torch_dist", 1), tmp)
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    prog("write", 1, 1)


# --------------------------------------------------------------------------- CLI
def run_cli(args) -> int:
    """Handler of ``tierckpt export-mcore``: rich progress bar, report; exit 0, or 2 on
    :class:`ExportError`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description:<8}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(phase, done, total):
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=max(total, 1))
            bar.update(tasks[phase], completed=done, total=max(total, 1))

        try:
            rep = export(args.src, args.dst, overwrite=args.overwrite, progress=progress)
        except ExportError as e:
            console.print(f"tierckpt: error: {e}")
            return 2
    if args.json:
        print(json.dumps(rep.__dict__, indent=2))
    else:
        print(f"exported {rep.src} -> {rep.dst}: TP={rep.tp} PP={rep.pp}, {rep.params} parameter shards, "
              f"{rep.tensors} tensors, {rep.objects} objects, {rep.bytes_written} bytes (fully_reshardable)")
    return 0
