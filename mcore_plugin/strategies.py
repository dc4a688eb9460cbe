"""Megatron-Core ``torch_dist`` save/load strategies backed by tierckpt's tiers.

Public API (stable; changes are announced here):

- :class:`MegatronTiers` — one :class:`tierckpt.engine.TieredCheckpointer` for Megatron state
  dicts (the dicts ``dist_checkpointing.save``/``load`` take: ShardedTensor/ShardedObject
  leaves plus "common" values such as ``iteration``, ``args``, ``opt_param_scheduler``).
  ``save(step, state_dict, tiers=…, persistent_state_dict=…)`` stages once and returns (δ);
  ``restore(state_dict_fn, step=None)`` loads from own local > peer replica > persistent.
- :class:`TieredSaveStrategy` — a save strategy with the contract of Megatron's
  ``FullyParallelSaveStrategyWrapper`` (``backend``/``version`` forwarded from the wrapped
  ``TorchDistSaveShardedStrategy``; ``async_save`` returns an ``AsyncRequest`` whose finalize
  function is the commit point; ``save`` = ``async_save`` + ``execute_sync``). It subclasses
  ``TorchDistSaveShardedStrategy`` because megatron-core 0.19's ``dist_checkpointing.save``
  silently replaces any strategy that is not one (0.16 only needs an
  ``AsyncSaveShardedStrategy``). Pass it as ``sharded_strategy`` to
  ``megatron.core.dist_checkpointing.save``.
- :class:`TieredLoadStrategy` — the load counterpart (subclasses
  ``TorchDistLoadShardedStrategy``; ``load_tensors_metadata``, ``load_sharded_metadata`` and
  the compatibility checks are forwarded to the wrapped one; ``load`` takes the step's tensors
  from the fastest verified source). Pass it as ``sharded_strategy`` to
  ``megatron.core.dist_checkpointing.load``.
- :class:`MegatronPersistentIO` — the persistent tier's :class:`tierckpt.tiers.persistent.PersistentIO`:
  ``<persistent_root>/step-<N>/`` is a complete ``torch_dist`` checkpoint (``.metadata``,
  ``__<r>_<t>.distcp`` written with Megatron's ``MCoreSavePlanner``, ``common.pt``,
  ``metadata.json``) plus tierckpt's manifest and commit marker, so stock
  ``megatron.core.dist_checkpointing.load`` reads it without this plugin.

Tiers and formats (mcore_plugin/README.md):

- local tier (+ replica): one DCP checkpoint per node written by the engine; Megatron's
  ShardedTensors become DCP-checkpointable chunks with *global* offsets (Megatron's own
  ``mcore_to_pyt_state_dict``), every replica a node holds is kept (each node must restore
  alone; DCP dedups inside the node); the distributed optimizer may use the cheap
  ``dp_reshardable`` format (same-topology restore).
- persistent tier: ``torch_dist`` with the distributed optimizer in ``fully_reshardable``
  format, so TP/PP/DP may change on load.

``state_dict_fn(sharding_type, is_loading) -> dict`` is how callers give both formats: it
returns the full Megatron state dict (model + optimizer + common) built with
``metadata={"distrib_optim_sharding_type": sharding_type}`` (Megatron-LM:
``generate_state_dict(..., optim_sd_kwargs=dict(metadata=…))``).

Creating a :class:`MegatronTiers` installs :mod:`mcore_plugin.optim_state` (per-parameter
Adam ``step`` on torch's AdamW fallback; a no-op with Apex/TE). Version notes: megatron-core
0.16 keeps the common state in ``common.pt`` and has ``strategies/base.py``; 0.19 dropped
``base.py`` and passes the common state as a ``common_state`` ShardedObject; only names present
in both are used here (the private torch_dist helpers ``_replace_state_dict_keys_with_sharded_keys``
and friends exist unchanged in both).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, CheckpointingException, save_config
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from tierckpt.config import TierConfig, validate_tiers
from tierckpt.io.dcp_io import crc32_off, digests_under, hashing_writer
from tierckpt.engine import TieredCheckpointer
from tierckpt.errors import ConfigError
from tierckpt.handle import SaveHandle
from tierckpt.io.dcp_io import CountingFileSystemReader, CountingFsspecReader
from tierckpt.tiers.persistent import PersistentIO
from tierckpt.io.planner import VerifyingLoadPlanner

log = logging.getLogger(__name__)

LOCAL_OPTIM_FORMAT = "dp_reshardable"
"""Distributed-optimizer format of the local tier (cheap; DP-only resharding)."""

PERSISTENT_OPTIM_FORMAT = "fully_reshardable"
"""Distributed-optimizer format of the persistent tier (any TP/PP/DP on load)."""

OPTIM_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
"""Distributed-optimizer formats the tiers accept (megatron-core's names)."""

StateDictFn = Callable[[str, bool], dict]
"""``state_dict_fn(distrib_optim_sharding_type, is_loading) -> Megatron state dict``."""

COMMON_KEY = "tierckpt.common"
"""Key of the common (non-sharded) state inside a local-tier DCP checkpoint."""
_TOP = "mcore"  # the one top-level key of the engine's state dict (a Stateful)

COMMON_FNAME = "common.pt"  # megatron.core.dist_checkpointing.core's name (both versions)
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


def _flat_copy(flat: dict) -> dict:
    """Shallow copies of the ShardedBase objects (Megatron's conversion mutates ``.data``;
    the local and persistent writers may convert the same staged copy concurrently)."""
    return {k: [copy.copy(x) for x in v] for k, v in flat.items()}


def _to_dcp(flat: dict, is_loading: bool, objects_as_bytes: bool) -> dict:
    """Megatron's torch_dist conversion (``mcore_to_pyt_state_dict``: global chunk offsets),
    with typed wrappers; ShardedObject groups become ``bytes`` of ``torch.save([data, …])``
    when ``objects_as_bytes`` (DCP's default planner pickles objects itself, and only one
    copy of an fqn is written per group)."""
    objs = {k: v for k, v in flat.items() if isinstance(v[0], ShardedObject)}
    tens = {k: v for k, v in flat.items() if not isinstance(v[0], ShardedObject)}
    out = {k: _retype(v) for k, v in mcore_to_pyt_state_dict(tens, is_loading).items()}
    if objects_as_bytes:
        for k, v in objs.items():
            buf = io.BytesIO()
            torch.save([None if is_loading else o.data for o in v], buf)
            out[k] = buf.getvalue()
    else:
        out.update(mcore_to_pyt_state_dict(objs, is_loading))
    return out


def _from_dcp(pyt: dict) -> dict:
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


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- staged payloads
class _Staged:
    """The state the engine stages: Megatron's ShardedBase objects (their tensors are copied
    into the engine's host buffers) and the common state. ``state_dict()`` is what the
    local tier's ``dcp.save`` writes (DCP resolves Stateful values itself)."""

    def __init__(self, sharded: dict, common: dict):
        self.sharded = sharded
        self.common = common

    def state_dict(self) -> dict:
        # every replica this rank holds: each node must restore alone; DCP dedups in the node
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(self.sharded, keep_only_main_replica=False)
        out = _to_dcp(_flat_copy(flat), False, objects_as_bytes=True)
        out[COMMON_KEY] = _to_bytes(self.common)
        return out

    def load_state_dict(self, state_dict) -> None:  # pragma: no cover - Stateful protocol
        raise RuntimeError("a staged save payload is never loaded")


class _Payload:
    """Top-level value handed to ``TieredCheckpointer.save``; the engine resolves it (Stateful)
    to the :class:`_Staged` it stages."""

    def __init__(self, staged: _Staged):
        self._staged = staged

    def state_dict(self) -> _Staged:
        return self._staged

    def load_state_dict(self, state_dict) -> None:  # pragma: no cover
        raise RuntimeError("a save payload is never loaded")


class _Restore:
    """Top-level value handed to ``TieredCheckpointer.restore``.

    Local/replica sources: ``dcp.load`` calls :meth:`state_dict` (template in the local
    optimizer format) then :meth:`load_state_dict`. Persistent source:
    :class:`MegatronPersistentIO` calls :meth:`load_torch_dist`. Either way :attr:`result`
    ends up holding the loaded Megatron state dict and :attr:`optim_format` its format.
    """

    def __init__(self, state_dict_fn: StateDictFn, local_fmt: str, persistent_fmt: str):
        self.fn = state_dict_fn
        self.local_fmt, self.persistent_fmt = local_fmt, persistent_fmt
        self.result: dict | None = None
        self.sharded_result: dict | None = None
        self.optim_format: str | None = None
        self.source_format: str | None = None
        self._ctx = None

    def _template(self, fmt: str) -> dict:
        full = self.fn(fmt, True)
        sharded, nonpersistent, factories = load_preprocess(full)
        sharded, _ = extract_sharded_base(sharded)
        flat, flat_mapping, rename = _replace_state_dict_keys_with_sharded_keys(sharded)
        self._ctx = (fmt, sharded, flat_mapping, rename, nonpersistent, factories)
        return flat

    def _finish(self, loaded_flat: dict, common: dict) -> None:
        fmt, sharded, flat_mapping, rename, nonpersistent, factories = self._ctx
        loaded = _replace_sharded_keys_with_state_dict_keys(_from_dcp(loaded_flat), flat_mapping, rename)
        _restore_dict_types(loaded, sharded)
        self.sharded_result = loaded
        merge(common, nonpersistent)
        merge(common, loaded)
        self.result = apply_factory_merges(common, factories)
        self.source_format = fmt
        self.optim_format = optimizer_format(self.result)

    # local / replica: DCP's Stateful protocol
    def state_dict(self) -> dict:
        pyt = _to_dcp(self._template(self.local_fmt), True, objects_as_bytes=True)
        pyt[COMMON_KEY] = b""
        return pyt

    def load_state_dict(self, pyt: dict) -> None:
        pyt = dict(pyt)
        common = torch.load(io.BytesIO(pyt.pop(COMMON_KEY)), weights_only=False)
        self._finish(pyt, common)

    # persistent: a torch_dist checkpoint
    def load_torch_dist(self, url: str, group) -> int:
        flat = self._template(self.persistent_fmt)
        sharded = self._ctx[1]
        pyt = _to_dcp(flat, True, objects_as_bytes=False)
        common, nbytes = _read_common(url)
        reader = CountingFsspecReader(url) if "://" in url else CountingFileSystemReader(url)
        planner = _VerifyingMCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in nested_values(sharded)
                                               if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in nested_values(sharded)
                                                  if isinstance(t, ShardedTensor) and t.allow_shape_mismatch},
        )
        dcp.load(pyt, storage_reader=reader, planner=planner, process_group=group)
        if common is None:  # megatron-core >= 0.19 without common.pt: the common_state object
            common = pyt_common(url)
        self._finish(pyt, common)
        return reader.bytes_read + nbytes


class _VerifyingMCoreLoadPlanner(VerifyingLoadPlanner, MCoreLoadPlanner):
    """Megatron's load planner (global-shape validation) plus tierckpt's coverage and dtype
    check (nothing is read unless every local chunk is fully covered with the same dtype)."""


def _read_common(url: str) -> tuple[dict | None, int]:
    path = f"{url.rstrip('/')}/{COMMON_FNAME}"
    if "://" in url:
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
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
    reader = CountingFsspecReader(url) if "://" in url else CountingFileSystemReader(url)
    dcp.load(pyt, storage_reader=reader, no_dist=True)
    v = pyt[key]
    if isinstance(v, io.BytesIO):
        v.seek(0)
        v = torch.load(v, weights_only=False)
    return v[0]


# --------------------------------------------------------------------------- persistent IO
class MegatronPersistentIO(PersistentIO):
    """Persistent-tier I/O writing and reading ``torch_dist`` checkpoints.

    ``save(staged, url, process_group)`` writes ``url`` (``<persistent_root>/step-<N>``) as a
    complete torch_dist checkpoint: DCP files planned by Megatron's ``MCoreSavePlanner``
    (main replicas only; ShardedObjects written by their main replica's rank), ``common.pt``
    (rank 0 of the group) and ``metadata.json`` (``torch_dist`` v1, Megatron's
    ``save_config``). ``load(state, url, group)`` reads it into the template of the pending
    restore (built in the ``fully_reshardable`` optimizer format) with Megatron's shape
    validation and tierckpt's coverage/dtype check, over ``group`` only (the node's ranks).
    Plain (non-Megatron) state dicts fall back to :class:`PersistentIO`.
    """

    def save(self, state_dict: dict, url: str, process_group) -> dict[str, tuple[int, str]]:
        staged = state_dict.get(_TOP) if isinstance(state_dict, dict) else None
        if not isinstance(staged, _Staged):
            return super().save(state_dict, url, process_group)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(staged.sharded, keep_only_main_replica=True)
        pyt = _to_dcp(_flat_copy(flat), False, objects_as_bytes=False)
        rank = dist.get_rank(process_group)
        if rank == 0:
            _write_common(url, staged.common)
        if "://" in url:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(url, sync_files=True)
        else:
            writer = hashing_writer(url)
        with crc32_off():
            dcp.save(pyt, storage_writer=writer, planner=MCoreSavePlanner(flatten_state_dict=False),
                     process_group=process_group)
        return digests_under(writer, url) if "://" not in url else {}

    def load(self, state_dict: dict, url: str, process_group) -> int:
        req = state_dict.get(_TOP) if isinstance(state_dict, dict) else None
        if not isinstance(req, _Restore):
            return super().load(state_dict, url, process_group)
        return req.load_torch_dist(url, process_group)


def _write_common(url: str, common: dict) -> None:
    """``common.pt`` and ``metadata.json`` of a torch_dist checkpoint (global rank 0 of the
    group; the engine's manifest covers both)."""
    data = _to_bytes(common)
    if "://" in url:
        import fsspec

        fs, p = fsspec.core.url_to_fs(url)
        fs.makedirs(p, exist_ok=True)
        fs.pipe_file(f"{p}/{COMMON_FNAME}", data)
        fs.pipe_file(f"{p}/metadata.json", json.dumps({
            "sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}).encode())
        return
    os.makedirs(url, exist_ok=True)
    with open(os.path.join(url, COMMON_FNAME), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    save_config(CheckpointingConfig("torch_dist", 1), url)


# --------------------------------------------------------------------------- MegatronTiers
def split_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """(sharded part, common part) of a Megatron state dict, as ``dist_checkpointing.save``
    splits it (factories applied, LocalNonPersistentObjects dropped; megatron-core 0.19's
    ``common_state`` object folded back into the common part)."""
    sharded, common = save_preprocess(state_dict, validate_access_integrity=False)
    obj = sharded.pop("common_state", None) if isinstance(sharded, dict) else None
    if isinstance(obj, ShardedObject) and isinstance(obj.data, dict):
        common = merge(dict(obj.data), common) if common else dict(obj.data)
    return sharded, common


class MegatronTiers:
    """Tiered checkpointing of Megatron-Core state dicts (create on every rank, collectively).

    Args:
        config: :class:`tierckpt.config.TierConfig` (``intervals`` drive :meth:`due`).
        node_id: explicit node id of this rank (tests/simulation); default from the environment.
        local_optim_format: distributed-optimizer format the local tier is written in
            (default :data:`LOCAL_OPTIM_FORMAT`).
        persistent_optim_format: format of the persistent tier (default
            :data:`PERSISTENT_OPTIM_FORMAT`).

    Attributes:
        engine: the underlying :class:`tierckpt.engine.TieredCheckpointer`.
        last_restore: :class:`tierckpt.restore.RestoreResult` of the last :meth:`restore`.
        last_restore_format: optimizer format of the state the last restore returned.

    Raises:
        ConfigError: invalid tier settings (option named), unknown optimizer format.
    """

    def __init__(self, config: TierConfig, *, node_id: int | None = None,
                 local_optim_format: str = LOCAL_OPTIM_FORMAT,
                 persistent_optim_format: str = PERSISTENT_OPTIM_FORMAT):
        for opt, v in (("local_optim_format", local_optim_format), ("persistent_optim_format", persistent_optim_format)):
            if v not in OPTIM_FORMATS:
                raise ConfigError(opt, f"unknown distributed-optimizer format {v!r}; allowed: {', '.join(OPTIM_FORMATS)}")
        self.local_fmt, self.persistent_fmt = local_optim_format, persistent_optim_format
        from . import optim_state

        optim_state.install()
        self.engine = TieredCheckpointer(config, node_id=node_id, persistent_io=MegatronPersistentIO())
        self.last_restore = None
        self.last_restore_format: str | None = None
        self._handles: dict[int, SaveHandle] = {}

    @property
    def tiers(self) -> tuple[str, ...]:
        """Configured tiers."""
        return self.engine.cfg.tiers

    def format_of(self, tier: str) -> str:
        """Distributed-optimizer format ``tier`` is written in."""
        return self.local_fmt if tier == "local" else self.persistent_fmt

    def due(self, step: int) -> list[str]:
        """Tiers due at ``step`` under ``TierConfig.intervals`` (fixed or adaptive, the same
        on every rank); all configured tiers when no intervals are configured."""
        if self.engine.cadence is None:
            return list(self.tiers)
        return self.engine.due(step)

    def observe_step(self, seconds: float) -> None:
        """Report a training step's wall time (seconds) to the adaptive scheduler."""
        self.engine.observe_step(seconds)

    def checkpoint_dir(self, step: int) -> str:
        """Directory or URL of the persistent tier's ``step`` (``<persistent_root>/step-<N>``),
        a stock torch_dist checkpoint once committed."""
        from tierckpt.io import layout

        return self.engine.persistent.store.url_of(layout.persistent_step(step))

    def save(self, step: int, state_dict: dict, *, tiers=None,
             persistent_state_dict: dict | None = None) -> SaveHandle:
        """Stage a Megatron state dict and write it to ``tiers`` in the background (collective).

        Args:
            step: training iteration (>= 0).
            state_dict: full Megatron state dict (ShardedBase leaves + common values), as
                given to ``dist_checkpointing.save``; used for the local tier and, unless
                ``persistent_state_dict`` is given, for the persistent tier.
            tiers: subset of the configured tiers (default: :meth:`due`).
            persistent_state_dict: the same state built with the persistent optimizer format.
        Returns:
            :class:`tierckpt.handle.SaveHandle` (``blocking_s``: δ in seconds; the state may
            change once this returns; one future per started tier).
        Raises:
            ConfigError: unknown or unconfigured tier.
            TierFailedError: the previous save of a due tier failed (tiers outside warn_only).
        """
        tiers = self.due(step) if tiers is None else list(validate_tiers(tiers))
        if not tiers:
            return SaveHandle(step, 0.0)
        parts = {"local": None, "persistent": None}
        base = split_state_dict(state_dict)
        for t in tiers:
            parts[t] = split_state_dict(persistent_state_dict) if (
                t == "persistent" and persistent_state_dict is not None) else base
        return self.save_parts(step, {t: parts[t] for t in tiers})

    def save_parts(self, step: int, parts: dict[str, tuple[dict, dict]]) -> SaveHandle:
        """Like :meth:`save` with already split ``{tier: (sharded, common)}``; tiers sharing
        the same parts object are staged once. Returns one handle for the step (δ summed over
        stagings)."""
        groups: list[tuple[tuple, list[str]]] = []
        for t, p in parts.items():
            for g in groups:
                if g[0] is p:
                    g[1].append(t)
                    break
            else:
                groups.append((p, [t]))
        handle = SaveHandle(step, 0.0)
        for (sharded, common), ts in groups:
            for t in ts:
                fmt = optimizer_format(common)
                if t == "persistent" and fmt not in (None, "fully_reshardable", "fully_sharded_model_space"):
                    log.warning("tierckpt mcore: persistent step %d holds the %s optimizer format; TP/PP "
                                "changes on load need `tierckpt export-mcore`", step, fmt)
            h = self.engine.save(step, {_TOP: _Payload(_Staged(sharded, common))}, tiers=ts)
            handle.blocking_s += h.blocking_s
            handle.futures.update(h.futures)
            handle.skipped.update(h.skipped)
        self._handles[step] = handle
        while len(self._handles) > 8:  # outcome() is asked for the latest saves only
            self._handles.pop(next(iter(self._handles)))
        return handle

    def wait(self, tiers=None, *, step: int | None = None) -> dict[str, bool]:
        """Block until the background writes of ``tiers`` (default all; only those started at
        ``step`` when given) are finished; the local tier at most ``local_wait_timeout_s``
        (see :meth:`tierckpt.engine.TieredCheckpointer.wait`). Returns ``{tier: finished}``."""
        return self.engine.wait(tiers, step=step)

    def outcome(self, step: int, tiers) -> dict[str, bool | None]:
        """{tier: True (committed) | False (failed or skipped) | None (not saved at ``step`` or
        still running)} of one of the last 8 saves, from its :class:`SaveHandle`; call after
        :meth:`wait`."""
        got = self._handles[step].outcome() if step in self._handles else {}
        return {t: got.get(t) for t in tiers}

    def restore(self, state_dict_fn: StateDictFn, step: int | None = None, *,
                part: str = "all", rollback: bool = False) -> dict | None:
        """Load the newest step every node can be served from (or ``step``), collectively.

        ``state_dict_fn(fmt, True)`` builds the template for the source chosen: the local
        format for own-local/peer-replica, the persistent format for persistent. An explicit
        ``step`` is read-only unless ``rollback`` (a training run resuming an older step: see
        :meth:`tierckpt.engine.TieredCheckpointer.restore`).

        Returns:
            the loaded Megatron state dict (common values + loaded tensors, like
            ``dist_checkpointing.load``; pass ``["model"]`` to ``model.load_state_dict`` and
            ``["optimizer"]`` to ``optimizer.load_state_dict``), or None when nothing is
            committed anywhere. ``last_restore`` holds the RestoreResult. ``part="sharded"``
            returns only the loaded sharded part (what a Megatron load strategy returns).
        Raises:
            NoCheckpointError: checkpoints exist but none could be restored.
        """
        req = _Restore(state_dict_fn, self.local_fmt, self.persistent_fmt)
        res = self.engine.restore({_TOP: req}, step=step, rollback=rollback)
        self.last_restore = res
        if res is None:
            return None
        self.last_restore_format = req.optim_format
        return req.sharded_result if part == "sharded" else req.result

    def read_common(self, step: int | None = None) -> tuple[int, dict] | None:
        """Megatron's common state (``args``, ``iteration``, …) of ``step`` (None: the newest
        step every node can be served from), read from one verified node-local copy instead of
        a full restore (collective; :func:`tierckpt.io.peek.read_item`). Megatron-LM's first,
        "rank0" load pass needs only this.

        Returns:
            ``(step, common dict)``, or None when no node-local copy could be read (the step is
            only in the persistent tier): run :meth:`restore` with an empty template then.
        """
        from tierckpt.io.peek import read_item

        got = read_item(self.engine, f"{_TOP}.{COMMON_KEY}", step)  # DCP flattens {"mcore": {...}}
        if got is None:
            return None
        return got[0], torch.load(io.BytesIO(got[1]), weights_only=False)

    def close(self, clean: bool = True, reason: str = "") -> None:
        """Finish background work and record the run's end (see TieredCheckpointer.close)."""
        self.engine.close(clean=clean, reason=reason)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(clean=exc_type is None, reason=repr(exc) if exc else "")


# --------------------------------------------------------------------------- strategies
def wait_for_file(path: str, timeout_s: float = 3600.0, poll_s: float = 0.05) -> None:
    """Block until ``path`` exists (the async half of :class:`TieredSaveStrategy`'s request;
    a module-level function, so Megatron's forked and spawned async workers can run it).

    Raises:
        TimeoutError: ``path`` did not appear within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tierckpt: background save did not finish within {timeout_s}s ({path})")
        time.sleep(poll_s)


class TieredSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron save strategy writing each save to the tiers due at its step.

    Args:
        tiers: the :class:`MegatronTiers` of this job.
        base: the wrapped ``TorchDistSaveShardedStrategy`` (backend/version forwarded);
            default: a new one (``torch_dist``, 1).
        state_dict_fn: builds the full state dict in another optimizer format when a due
            tier's format differs from the one received (see the module docstring); without
            it the received dict is written to every due tier.
        step: iteration of the next save; otherwise :meth:`set_step` or parsed from
            ``checkpoint_dir`` (``iter_0000010``, ``step-10``).
        timeout_s: longest wait of the async half for the background writes (seconds).

    ``async_save(sharded_state_dict, checkpoint_dir, *args)`` stages once per format
    (blocking time δ), starts the due tiers in the background and returns an ``AsyncRequest``:
    its ``async_fn`` (:func:`wait_for_file`, safe in Megatron's forked or spawned async
    workers) returns when this rank's tier jobs are done; its finalize function is the commit
    point: it checks the due tiers committed (a failed persistent tier raises
    ``CheckpointingException``; a failed local tier is logged, since the engine never lets the
    local tier stop training). Common state: megatron-core 0.16 writes ``common.pt`` into
    ``checkpoint_dir`` before calling the strategy (rank 0 reads it back and broadcasts it over
    the default process group, in the foreground like Megatron's own save collectives; the
    engine's gloo groups are left to its background threads);
    0.19 passes it as the ``common_state`` ShardedObject; :meth:`set_common_state` overrides
    both. The sharded part is written to the tiers only, never to ``checkpoint_dir``: the
    persistent copy is :meth:`MegatronTiers.checkpoint_dir` (pass that as ``checkpoint_dir``
    to keep Megatron's ``common.pt``/``metadata.json`` in the same directory).
    """

    def __init__(self, tiers: MegatronTiers, base: TorchDistSaveShardedStrategy | None = None, *,
                 state_dict_fn: StateDictFn | None = None, step: int | None = None,
                 timeout_s: float = 3600.0):
        base = base if base is not None else TorchDistSaveShardedStrategy("torch_dist", 1)
        super().__init__(base.backend, base.version)
        self.base_strategy = base
        self.tiers = tiers
        self.state_dict_fn = state_dict_fn
        self._step = step
        self._common: dict | None = None
        self.timeout_s = timeout_s
        self.last_delta: float | None = None

    def set_step(self, step: int) -> None:
        """Iteration of the next save (else parsed from ``checkpoint_dir``)."""
        self._step = int(step)

    def set_common_state(self, common: dict | None) -> None:
        """Common (non-sharded) state of the next save (else as described in the class doc)."""
        self._common = common

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        """Synchronous save: ``async_save`` + ``execute_sync`` (returns once committed)."""
        self.async_save(sharded_state_dict, checkpoint_dir, *args, **kwargs).execute_sync()

    def _common_state(self, sharded: dict, checkpoint_dir) -> dict:
        if self._common is not None:
            return self._common
        obj = sharded.get("common_state")
        if isinstance(obj, ShardedObject) and isinstance(obj.data, dict):  # megatron-core >= 0.19
            write_common_pt(checkpoint_dir, obj.data)
            return obj.data
        # megatron-core 0.16: dist_checkpointing.save wrote common.pt on global rank 0 already.
        # Shared over the default group in the foreground, as Megatron's own save does: the
        # engine's gloo groups belong to its background threads (two threads' collectives on
        # one group interleave differently on each rank).
        data = None
        if dist.get_rank() == 0:
            path = os.path.join(str(checkpoint_dir), COMMON_FNAME)
            data = Path(path).read_bytes() if os.path.exists(path) else b""
        box = [data]
        dist.broadcast_object_list(box, src=0)
        data = box[0]
        return torch.load(io.BytesIO(data), weights_only=False) if data else {}

    def async_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs) -> AsyncRequest:
        """Stage and start the due tiers; see the class docstring. Collective."""
        step = self._step if self._step is not None else parse_step(checkpoint_dir)
        if step is None:
            raise CheckpointingException(
                f"tierckpt: cannot tell the iteration of {checkpoint_dir!r}; call set_step() first")
        self._step = None
        due = self.tiers.due(step)
        sharded = {k: v for k, v in sharded_state_dict.items() if k != "common_state"}
        common = self._common_state(sharded_state_dict, checkpoint_dir)
        self._common = None
        received = (sharded, common)
        got = optimizer_format(common)
        parts = {}
        for t in due:
            want = self.tiers.format_of(t)
            if self.state_dict_fn is not None and got is not None and got != want:
                parts[t] = next((p for p in parts.values() if optimizer_format(p[1]) == want), None) \
                    or split_state_dict(self.state_dict_fn(want, False))
            else:
                parts[t] = received
        done = os.path.join(tempfile.gettempdir(), f"tierckpt-mcore-{os.getpid()}-{uuid.uuid4().hex}.done")
        self.last_delta = self.tiers.save_parts(step, parts).blocking_s if parts else 0.0

        def watch():
            try:
                # only this step's jobs; the local tier at most local_wait_timeout_s, so a hung
                # node-local disk never holds back the persistent commit (finalize checks it)
                self.tiers.wait(due, step=step)
            finally:
                Path(done).write_bytes(b"done\n")

        threading.Thread(target=watch, name=f"tierckpt-mcore-watch-{step}", daemon=True).start()
        tiers_obj = self.tiers

        def finalize():
            wait_for_file(done, self.timeout_s)  # sync callers and the same-process path
            try:
                os.remove(done)
            except OSError:
                pass
            out = tiers_obj.outcome(step, due)
            failed = [t for t, ok in out.items() if ok is False]
            # Megatron writes its tracker file after this returns: only a save the engine
            # recorded as committed may count (no record = the stats gather failed too).
            if "persistent" in due and out.get("persistent") is not True:
                raise CheckpointingException(f"tierckpt: persistent tier of step {step} is not committed "
                                             f"({'failed' if 'persistent' in failed else 'no record'}; see the ledger)")
            if failed:
                log.warning("tierckpt mcore: step %d: %s tier failed; training continues", step, ", ".join(failed))

        return AsyncRequest(wait_for_file, (done, self.timeout_s), [finalize])


def write_common_pt(checkpoint_dir, common: dict) -> None:
    """megatron-core >= 0.19: write the common state as ``<checkpoint_dir>/common.pt`` on global
    rank 0 (temp file, fsync, rename).

    Why: 0.19 keeps the common state only as the ``common_state`` ShardedObject inside the
    torch_dist files, but :class:`TieredSaveStrategy` writes those to the tiers, never to
    ``checkpoint_dir``; a stock load of ``checkpoint_dir`` (``load_common_state_dict``, e.g.
    Megatron-LM's ``iter_N``) would find no common state. 0.19 still reads a legacy
    ``common.pt`` first, and 0.16 writes one itself.
    """
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = os.path.join(str(checkpoint_dir), COMMON_FNAME)
    os.makedirs(str(checkpoint_dir), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(common, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class TieredLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron load strategy: the sharded part of ``checkpoint_dir``'s step from the fastest
    verified source (own local > peer replica > persistent). Megatron loads the common state
    from ``checkpoint_dir`` and merges what ``load`` returns over it; ``load`` returns the
    tier's common values too (saved at the same step), so the optimizer's format marker
    (``param_state_sharding_type``) always matches the tensors actually loaded.

    Args:
        tiers: the :class:`MegatronTiers` of this job.
        base: wrapped ``TorchDistLoadShardedStrategy`` (``load_tensors_metadata``,
            ``load_sharded_metadata`` and the compatibility checks are forwarded to it).
        state_dict_fn: builds the template in another optimizer format when the source chosen
            holds a different one than the template passed to ``load``; without it the given
            template is used for every source.
        step: step to load; default parsed from ``checkpoint_dir``.
        rollback: the step was named explicitly by a training run (``--ckpt-step``): newer
            steps are superseded at its first commit. Default read-only.

    Attributes:
        last_restore: RestoreResult of the last load.

    Limit: with ``state_dict_fn`` and ShardedTensorFactories (e.g. SwiGLU's fused
    ``linear_fc1``), a source in another format than the template Megatron was given is
    merged with the template's factories; keep the formats equal there.
    """

    def __init__(self, tiers: MegatronTiers, base: TorchDistLoadShardedStrategy | None = None, *,
                 state_dict_fn: StateDictFn | None = None, step: int | None = None,
                 rollback: bool = False):
        super().__init__()
        self.base_strategy = base if base is not None else TorchDistLoadShardedStrategy()
        self.tiers = tiers
        self.state_dict_fn = state_dict_fn
        self.step = step
        self.rollback = rollback
        self.last_restore = None

    @property
    def can_handle_sharded_objects(self):
        return True

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        """Load the step (collective). Returns the loaded sharded part plus the tier's common
        values (see the class docstring), which Megatron merges over ``checkpoint_dir``'s.

        Raises:
            CheckpointingException: no step, or ``NoCheckpointError`` from the engine.
        """
        step = self.step if self.step is not None else parse_step(checkpoint_dir)
        if step is None:
            raise CheckpointingException(f"tierckpt: cannot tell the step of {checkpoint_dir!r}; pass step=")
        given = sharded_state_dict

        def fn(fmt, is_loading):
            if self.state_dict_fn is None:
                return given
            sd = self.state_dict_fn(fmt, True)
            sharded, _, _ = load_preprocess(sd)
            sharded, _ = extract_sharded_base(sharded)
            return sharded

        got = self.tiers.restore(fn, step=step, rollback=self.rollback)
        self.last_restore = self.tiers.last_restore
        # Megatron merges this over checkpoint_dir's common state and refuses duplicate
        # values: drop what that common state already holds, keep the rest of the tier's
        # (e.g. the optimizer's param groups, which only the fully_reshardable format keeps
        # in the common part), and tell the optimizer which format the tensors really are in.
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        out = _strip_present(got, load_common_state_dict(str(checkpoint_dir)))
        fmt = self.tiers.last_restore_format
        if fmt:
            from .optim_state import FORMAT_OVERRIDE_KEY

            for d in _dicts_with(out, "param_state"):
                d[FORMAT_OVERRIDE_KEY] = fmt
        return out

    def load_tensors_metadata(self, checkpoint_dir, *args, **kwargs):
        """Forwarded to the wrapped strategy."""
        return self.base_strategy.load_tensors_metadata(checkpoint_dir, *args, **kwargs)

    def load_sharded_metadata(self, checkpoint_dir, *args, **kwargs):
        """Forwarded to the wrapped strategy."""
        return self.base_strategy.load_sharded_metadata(checkpoint_dir, *args, **kwargs)

    def check_backend_compatibility(self, loaded_backend):
        """Forwarded to the wrapped strategy."""
        return self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version):
        """Forwarded to the wrapped strategy."""
        return self.base_strategy.check_version_compatibility(loaded_version)



def _strip_present(x, present):
    """``x`` without the leaves ``present`` also has (dicts recursed; emptied dicts dropped)."""
    if not isinstance(x, dict) or not isinstance(present, dict):
        return x
    out = {}
    for k, v in x.items():
        if k not in present:
            out[k] = v
        elif isinstance(v, dict) and isinstance(present[k], dict):
            sub = _strip_present(v, present[k])
            if sub:
                out[k] = sub
    return out


def _dicts_with(x, key: str):
    """Every dict (at any depth) of ``x`` holding ``key``."""
    stack, found = [x], []
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            if key in d:
                found.append(d)
            stack.extend(d.values())
    return found
