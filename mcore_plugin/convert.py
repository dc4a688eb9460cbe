"""Megatron-Core state dicts ↔ the DCP state dicts the tiers write and read.

- local tier (+ replica): one DCP checkpoint per node. Megatron's ShardedTensors become
  DCP-checkpointable chunks with *global* offsets (Megatron's own ``mcore_to_pyt_state_dict``);
  every replica a node holds is kept (each node must restore alone; DCP dedups inside the
  node); ShardedObjects and the common state are ``torch.save`` bytes.
- persistent tier: a stock ``torch_dist`` checkpoint (main replicas only, ``MCoreSavePlanner``;
  :mod:`mcore_plugin.persistent_io`).

:class:`Staged` is what the engine stages for a save, :class:`RestoreRequest` what it restores
into; both sit under the one top-level key :data:`TOP_KEY` of the engine's state dict.
"""

from __future__ import annotations

import copy
import io
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from tierckpt.io.dcp_io import CountingFileSystemReader, CountingFsspecReader
from tierckpt.io.planner import VerifyingLoadPlanner

from .layout import LAYOUT_KEY

StateDictFn = Callable[[str, bool], dict]
"""``state_dict_fn(distrib_optim_sharding_type, is_loading) -> Megatron state dict``."""

COMMON_KEY = "tierckpt.common"
"""Key of the common (non-sharded) state inside a local-tier DCP checkpoint."""

TOP_KEY = "mcore"
"""The one top-level key of the engine's state dict (a Stateful: :class:`Payload` or
:class:`RestoreRequest`)."""

COMMON_FNAME = "common.pt"
"""megatron.core.dist_checkpointing.core's name of the common state file (0.16 and 0.19)."""

_STEP_RE = re.compile(r"^(?:iter_|step-)(\d+)$")


def parse_step(checkpoint_dir) -> int | None:
    """Iteration encoded in a checkpoint directory name: ``iter_0000010`` → 10, ``step-10`` → 10,
    anything else → None."""
    m = _STEP_RE.match(Path(str(checkpoint_dir).rstrip("/")).name)
    return int(m.group(1)) if m else None


def optimizer_format(common: dict) -> str | None:
    """The distributed-optimizer format recorded in a Megatron common state dict
    (``param_state_sharding_type``, searched at any depth), or None."""
    stack = [common]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            v = d.get("param_state_sharding_type")
            if isinstance(v, str):
                return v
            stack.extend(d.values())
    return None


def split_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """(sharded part, common part) of a Megatron state dict, as ``dist_checkpointing.save``
    splits it (factories applied, LocalNonPersistentObjects dropped; megatron-core 0.19's
    ``common_state`` object folded back into the common part)."""
    sharded, common = save_preprocess(state_dict, validate_access_integrity=False)
    obj = sharded.pop("common_state", None) if isinstance(sharded, dict) else None
    if isinstance(obj, ShardedObject) and isinstance(obj.data, dict):
        common = merge(dict(obj.data), common) if common else dict(obj.data)
    return sharded, common


# --------------------------------------------------------------------------- DCP conversion
class _TypedShard(CheckpointableShardedTensor):
    """Megatron's CheckpointableShardedTensor with the shard's real dtype (the wrapper reports
    float32 otherwise, and tierckpt's load planner refuses dtype changes)."""

    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(sh_ten.global_shape), dtype=sh_ten.data.dtype)


class _TypedShards(LocalShardsContainer):
    """LocalShardsContainer with the shards' dtype (see :class:`_TypedShard`)."""

    @staticmethod
    def __new__(cls, local_shards):
        return torch.Tensor._make_wrapper_subclass(cls, local_shards[0].size(), dtype=local_shards[0].dtype)


def _retype(v):
    if isinstance(v, LocalShardsContainer):
        return _TypedShards([_TypedShard(s._sh_ten.data, s._sh_ten) for s in v._local_shards])
    if isinstance(v, CheckpointableShardedTensor):
        return _TypedShard(v._sh_ten.data, v._sh_ten)
    return v


def flat_copy(flat: dict) -> dict:
    """Shallow copies of the ShardedBase objects of a flat ``{key: [ShardedBase, …]}`` (Megatron's
    conversion mutates ``.data``; the local and persistent writers may convert the same staged
    copy concurrently)."""
    return {k: [copy.copy(x) for x in v] for k, v in flat.items()}


def to_dcp(flat: dict, is_loading: bool, objects_as_bytes: bool) -> dict:
    """Megatron's torch_dist conversion (``mcore_to_pyt_state_dict``: global chunk offsets),
    with typed wrappers; ShardedObject groups become ``bytes`` of ``torch.save([data, …])``
    when ``objects_as_bytes`` (DCP's default planner pickles objects itself, and only one
    copy of an fqn is written per group)."""
    objs = {k: v for k, v in flat.items() if isinstance(v[0], ShardedObject)}
    tens = {k: v for k, v in flat.items() if not isinstance(v[0], ShardedObject)}
    out = {k: _retype(v) for k, v in mcore_to_pyt_state_dict(tens, is_loading).items()}
    if objects_as_bytes:
        for k, v in objs.items():
            out[k] = to_bytes([None if is_loading else o.data for o in v])
    else:
        out.update(mcore_to_pyt_state_dict(objs, is_loading))
    return out


def from_dcp(pyt: dict) -> dict:
    """Loaded DCP values back to Megatron's per-key lists."""
    out = {}
    for k, v in pyt.items():
        if isinstance(v, bytes):
            v = torch.load(io.BytesIO(v), weights_only=False)
        elif isinstance(v, io.BytesIO):
            v.seek(0)
            v = torch.load(v, weights_only=False)
        out[k] = _unwrap_pyt_sharded_tensor(v)
    return out


def to_bytes(obj) -> bytes:
    """``torch.save(obj)`` as bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- staged payloads
class Staged:
    """The state the engine stages: Megatron's ShardedBase objects (their tensors are copied
    into the engine's host buffers), the common state and the parallel layout it was saved
    under (:func:`mcore_plugin.layout.parallel_layout`, or None). ``state_dict()`` is what the
    local tier's ``dcp.save`` writes (DCP resolves Stateful values itself)."""

    def __init__(self, sharded: dict, common: dict, layout: dict | None = None):
        self.sharded = sharded
        self.common = common
        self.layout = layout

    def state_dict(self) -> dict:
        # every replica this rank holds: each node must restore alone; DCP dedups in the node
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(self.sharded, keep_only_main_replica=False)
        out = to_dcp(flat_copy(flat), False, objects_as_bytes=True)
        out[COMMON_KEY] = to_bytes(self.common)
        if self.layout is not None:  # a restore under another layout must know (mcore_plugin.layout)
            out[LAYOUT_KEY] = to_bytes(self.layout)
        return out

    def load_state_dict(self, state_dict) -> None:  # pragma: no cover - Stateful protocol
        raise RuntimeError("a staged save payload is never loaded")

    # The engine's copy plan (tierckpt.staging.copy_plan.TensorHolder): from the second save of the
    # same sharded layout on, the engine refills its staged copy of this object instead of
    # DCP's deep copy of every ShardedTensor (and may copy the large ones in the background
    # with cpu_staging = "overlapped").
    def _leaves(self) -> list[tuple[str, Any]]:
        # the sharded dict is not changed after construction: walked once (per save: key,
        # tensors and refresh read it)
        cached = self.__dict__.get("_leaves_cache")
        if cached is not None:
            return cached
        out: list[tuple[str, Any]] = []  # Megatron's (untyped) ShardedTensor/ShardedObject leaves
        stack: list[tuple[str, object]] = [("", self.sharded)]
        while stack:
            path, x = stack.pop()
            if isinstance(x, dict):
                stack.extend((f"{path}.{k}" if path else str(k), x[k]) for k in reversed(list(x)))
            elif isinstance(x, list):
                stack.extend((f"{path}.{j}" if path else str(j), x[j]) for j in reversed(range(len(x))))
            else:
                out.append((path, x))
        self._leaves_cache = out
        # two leaves under one dotted path (keys 0 and "0", "a.b" and a → b) cannot be named apart
        self._paths_unique = len({path for path, _ in out}) == len(out)
        return out

    def staging_key(self):
        """Every ShardedTensor's metadata (all dataclass fields but ``data``; its dtype, shape,
        device) and every ShardedObject's key, offsets and replica id, by path, plus the parallel
        layout; None when the sharded part holds anything else or two leaves share a path
        (DCP's deep copy then)."""
        leaves = self._leaves()
        if not self._paths_unique:
            return None
        key = []
        meta = _sharded_tensor_meta()
        for path, x in leaves:
            if type(x) is ShardedTensor and isinstance(x.data, torch.Tensor):
                key.append((path, x.data.dtype, x.data.shape, x.data.device, meta(x)))
            elif type(x) is ShardedObject:
                key.append((path, x.key, x.global_shape, x.global_offset, x.replica_id))
            else:
                return None
        return tuple(key), self.layout

    def staging_tensors(self) -> dict[str, torch.Tensor]:
        """The ``data`` of every ShardedTensor, by path in the sharded state dict."""
        return {path: x.data for path, x in self._leaves() if type(x) is ShardedTensor}

    def staging_refresh(self, live: "Staged") -> None:
        """Take over ``live``'s common state, layout and ShardedObject data (deep copies: the
        trainer may change them after the save returns); the ShardedTensors' metadata is equal
        by key and their data is refilled by the engine."""
        self.common = copy.deepcopy(live.common)
        self.layout = copy.deepcopy(live.layout)
        for (_, mine), (_, theirs) in zip(self._leaves(), live._leaves()):
            if type(mine) is ShardedObject:
                mine.data = copy.deepcopy(theirs.data)


_ST_META: Callable | None = None


def _sharded_tensor_meta() -> Callable:
    """A getter of a ShardedTensor's dataclass fields but ``data``, as a tuple (the fields
    differ between megatron-core versions)."""
    global _ST_META
    if _ST_META is None:
        import dataclasses
        import operator

        _ST_META = operator.attrgetter(*(f.name for f in dataclasses.fields(ShardedTensor) if f.name != "data"))
    return _ST_META


class Payload:
    """Top-level value handed to ``TieredCheckpointer.save``; the engine resolves it (Stateful)
    to the :class:`Staged` it stages."""

    def __init__(self, staged: Staged):
        self._staged = staged

    def state_dict(self) -> Staged:
        return self._staged

    def load_state_dict(self, state_dict) -> None:  # pragma: no cover
        raise RuntimeError("a save payload is never loaded")


class RestoreRequest:
    """Top-level value handed to ``TieredCheckpointer.restore``.

    Local/replica sources: ``dcp.load`` calls :meth:`state_dict` (template in the local
    optimizer format) then :meth:`load_state_dict`. Persistent source: the persistent tier
    calls :meth:`persistent_template` then :meth:`finish_persistent` (through
    :class:`mcore_plugin.persistent_io.MegatronPersistentIO`). Either way :attr:`result` ends
    up holding the loaded Megatron state dict and :attr:`optim_format` its format.
    """

    def __init__(self, state_dict_fn: StateDictFn, local_fmt: str, persistent_fmt: str):
        self.fn = state_dict_fn
        self.local_fmt, self.persistent_fmt = local_fmt, persistent_fmt
        self.result: dict | None = None
        self.sharded_result: dict | None = None
        self.optim_format: str | None = None
        self.source_format: str | None = None
        # (format, sharded, flat_mapping, rename, nonpersistent, factories) of the last template
        self._ctx: tuple[Any, ...] | None = None

    def _template(self, fmt: str) -> dict:
        full = self.fn(fmt, True)
        sharded, nonpersistent, factories = load_preprocess(full)
        sharded, _ = extract_sharded_base(sharded)
        flat, flat_mapping, rename = _replace_state_dict_keys_with_sharded_keys(sharded)
        self._ctx = (fmt, sharded, flat_mapping, rename, nonpersistent, factories)
        return flat

    def _finish(self, loaded_flat: dict, common: dict) -> None:
        if self._ctx is None:
            raise RuntimeError("RestoreRequest: load before a template was built")
        fmt, sharded, flat_mapping, rename, nonpersistent, factories = self._ctx
        loaded = _replace_sharded_keys_with_state_dict_keys(from_dcp(loaded_flat), flat_mapping, rename)
        _restore_dict_types(loaded, sharded)
        self.sharded_result = loaded
        merge(common, nonpersistent)
        merge(common, loaded)
        self.result = apply_factory_merges(common, factories)
        self.source_format = fmt
        self.optim_format = optimizer_format(self.result)

    # local / replica: DCP's Stateful protocol
    def state_dict(self) -> dict:
        pyt = to_dcp(self._template(self.local_fmt), True, objects_as_bytes=True)
        pyt[COMMON_KEY] = b""
        return pyt

    def load_state_dict(self, pyt: dict) -> None:
        pyt = dict(pyt)
        common = torch.load(io.BytesIO(pyt.pop(COMMON_KEY)), weights_only=False)
        self._finish(pyt, common)

    # persistent: a torch_dist checkpoint
    def persistent_template(self) -> tuple[dict, VerifyingLoadPlanner]:
        """The DCP dict a torch_dist step loads into (persistent optimizer format) and its
        planner: Megatron's global-shape validation plus tierckpt's coverage/dtype check."""
        pyt = to_dcp(self._template(self.persistent_fmt), True, objects_as_bytes=False)
        assert self._ctx is not None  # set by _template() above
        tensors = [t for t in nested_values(self._ctx[1]) if isinstance(t, ShardedTensor)]
        # the keywords are MCoreLoadPlanner's (untyped module): mypy sees VerifyingLoadPlanner's
        planner = _VerifyingMCoreLoadPlanner(  # type: ignore[call-arg]
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
        )
        return pyt, planner

    def finish_persistent(self, pyt: dict, url: str) -> int:
        """Build :attr:`result` from the loaded ``pyt`` and the step's common state
        (``common.pt``, or 0.19's ``common_state`` object). Returns bytes of ``common.pt`` read."""
        common, nbytes = read_common(url)
        if common is None:  # megatron-core >= 0.19 without common.pt: the common_state object
            common = pyt_common(url)
        self._finish(pyt, common)
        return nbytes


class _VerifyingMCoreLoadPlanner(VerifyingLoadPlanner, MCoreLoadPlanner):
    """Megatron's load planner (global-shape validation) plus tierckpt's coverage and dtype
    check (nothing is read unless every local chunk is fully covered with the same dtype)."""

    def shape_may_differ(self, fqn: str) -> bool:
        # Megatron's allow_shape_mismatch tensors: its planner loads them at the template's shape
        return fqn in (self.allow_shape_mismatch_sharded_tensors or {})


def read_common(url: str) -> tuple[dict | None, int]:
    """``(common state, bytes read)`` of ``<url>/common.pt``; ``(None, 0)`` when absent."""
    path = f"{url.rstrip('/')}/{COMMON_FNAME}"
    if "://" in url:
        import fsspec

        from tierckpt.io.storage import options_under

        fs, p = fsspec.core.url_to_fs(path, **options_under(url))
        if not fs.exists(p):
            return None, 0
        data = fs.cat_file(p)
    else:
        if not os.path.exists(path):
            return None, 0
        data = Path(path).read_bytes()
    return torch.load(io.BytesIO(data), weights_only=False), len(data)


def pyt_common(url: str) -> dict:
    """Common state stored as megatron-core 0.19's ``common_state`` ShardedObject."""
    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    pyt = {key: io.BytesIO()}
    if "://" in url:
        from tierckpt.io.storage import options_under

        reader = CountingFsspecReader(url, **options_under(url))
    else:
        reader = CountingFileSystemReader(url)
    dcp.load(pyt, storage_reader=reader, no_dist=True)
    v = pyt[key]
    if isinstance(v, io.BytesIO):
        v.seek(0)
        v = torch.load(v, weights_only=False)
    return v[0]
