"""Megatron-Core ``torch_dist`` save/load strategies backed by tierckpt's tiers.

Public API (stable; changes are announced here):

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
- re-exported here: :class:`~mcore_plugin.tiers.MegatronTiers` (the tiers themselves),
  :class:`~mcore_plugin.persistent_io.MegatronPersistentIO` (the persistent tier's
  ``torch_dist`` hooks) and the format names of :mod:`mcore_plugin.tiers` /
  :mod:`mcore_plugin.convert`.

Version notes: megatron-core 0.16 keeps the common state in ``common.pt`` and has
``strategies/base.py``; 0.19 dropped ``base.py`` and passes the common state as a
``common_state`` ShardedObject; only names present in both are used here (the private
torch_dist helpers ``_replace_state_dict_keys_with_sharded_keys`` and friends exist unchanged
in both).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from tierckpt import SaveHandle

from .convert import (  # noqa: F401 - re-exported (public names of this module before the split)
    COMMON_FNAME,
    COMMON_KEY,
    StateDictFn,
    optimizer_format,
    parse_step,
    pyt_common,
    split_state_dict,
)
from . import metadata
from .persistent_io import MegatronPersistentIO  # noqa: F401 - re-exported
from .tiers import (  # noqa: F401 - re-exported
    LOCAL_OPTIM_FORMAT,
    OPTIM_FORMATS,
    PERSISTENT_OPTIM_FORMAT,
    MegatronTiers,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- async completion
def wait_for_tiers(signal, timeout_s: float = 3600.0) -> None:
    """The ``async_fn`` of :class:`TieredSaveStrategy`'s request: block until the trainer
    reports this rank's tier jobs done (one message on ``signal``, the read end of a
    :class:`_Completion`'s pipe). Module-level, so a spawned worker can unpickle it by name.

    Raises:
        TimeoutError: no message within ``timeout_s`` seconds.
        EOFError: the trainer closed the pipe without reporting.
    """
    if not signal.poll(timeout_s):
        raise TimeoutError(f"tierckpt: background save did not finish within {timeout_s}s")
    signal.recv()


class _Completion:
    """"This step's tiers are done", from the trainer to wherever Megatron runs ``async_fn``.

    Why a pipe: Megatron runs an ``AsyncRequest``'s ``async_fn`` in a forked process
    (``TemporalAsyncCaller``, Megatron-LM's default; it inherits the read end), in a spawned
    persistent worker that receives the request pickled through a multiprocessing queue
    (``PersistentAsyncCaller``, ``--use-persistent-ckpt-worker``; multiprocessing passes the
    descriptor with the pickled ``Connection``, 0.16 and 0.19 alike), or in the trainer itself
    (``execute_sync``). The tier futures live in the trainer process only, so a waiter thread
    there blocks on them and sends one message; ``async_fn`` (:func:`wait_for_tiers`) blocks
    on the read end until it arrives. No file, no polling.

    Args:
        tiers: the :class:`MegatronTiers` (or a wrapper) whose ``wait`` the thread calls.
        handle: the step's :class:`tierckpt.SaveHandle`; only the tiers it started are waited
            for, the local tier at most ``local_wait_timeout_s`` (a hung node-local disk must
            never hold back the persistent commit; the finalize function reports it).
    """

    def __init__(self, tiers, handle: SaveHandle):
        self.reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(tiers, handle), daemon=True,
                         name=f"tierckpt-mcore-done-{handle.step}").start()

    def _watch(self, tiers, handle: SaveHandle) -> None:
        try:
            if handle.futures:
                tiers.wait(list(handle.futures), step=handle.step)
        finally:
            self._done.set()
            try:
                self._writer.send(True)
            finally:
                self._writer.close()

    def wait(self, timeout_s: float) -> bool:
        """Block (in the trainer) until the waiter finished; False after ``timeout_s`` seconds."""
        return self._done.wait(timeout_s)

    def close(self) -> None:
        """Close the trainer's read end (a worker holds its own copy)."""
        self.reader.close()


# --------------------------------------------------------------------------- save strategy
class TieredSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron save strategy writing each save to the tiers due at its step.

    Args:
        tiers: the :class:`MegatronTiers` of this job.
        base: the wrapped ``TorchDistSaveShardedStrategy`` (backend/version forwarded);
            default: a new one (``torch_dist``, 1).
        state_dict_fn: builds the full state dict in another optimizer format when a due
            tier's format differs from the one received (see :mod:`mcore_plugin.tiers`);
            without it the received dict is written to every due tier.
        step: iteration of the next save; otherwise :meth:`set_step` or parsed from
            ``checkpoint_dir`` (``iter_0000010``, ``step-10``).
        timeout_s: longest wait of the async half for the background writes (seconds).

    Attributes:
        last_delta: δ of the last save (seconds the trainer was blocked).
        last_handle: :class:`tierckpt.SaveHandle` of the last save.

    ``async_save(sharded_state_dict, checkpoint_dir, *args)`` stages once per format
    (blocking time δ), starts the due tiers in the background and returns an ``AsyncRequest``:
    its ``async_fn`` (:func:`wait_for_tiers`, see :class:`_Completion` for why it is correct
    in Megatron's forked and spawned workers and in-process) returns when this rank's tier
    jobs are done; its finalize function is the commit point: it checks the due tiers
    committed (a failed persistent tier raises ``CheckpointingException``; a failed local tier
    is logged, since the engine never lets the local tier stop training). Common state:
    megatron-core 0.16 writes ``common.pt`` into ``checkpoint_dir`` before calling the
    strategy (rank 0 reads it back and broadcasts it over the default process group, in the
    foreground like Megatron's own save collectives; the engine's gloo groups are left to its
    background threads); 0.19 passes it as the ``common_state`` ShardedObject;
    :meth:`set_common_state` overrides both. The sharded part is written to the tiers only,
    never to ``checkpoint_dir``: the persistent copy is :meth:`MegatronTiers.checkpoint_dir`
    (pass that as ``checkpoint_dir`` to keep Megatron's ``common.pt``/``metadata.json`` in the
    same directory).
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
        self.last_handle: SaveHandle | None = None

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

    def _parts(self, due: list[str], sharded_state_dict: dict, checkpoint_dir) -> dict[str, tuple[dict, dict]]:
        """``{tier: (sharded, common)}`` of the due tiers: the received dict, or the dict rebuilt
        in the tier's optimizer format (one rebuild per format)."""
        sharded = {k: v for k, v in sharded_state_dict.items() if k != "common_state"}
        common = self._common_state(sharded_state_dict, checkpoint_dir)
        self._common = None
        received = (sharded, common)
        got = optimizer_format(common)
        parts: dict[str, tuple[dict, dict]] = {}
        for t in due:
            want = self.tiers.format_of(t)
            if self.state_dict_fn is not None and got is not None and got != want:
                parts[t] = next((p for p in parts.values() if optimizer_format(p[1]) == want), None) \
                    or split_state_dict(self.state_dict_fn(want, False))
            else:
                parts[t] = received
        return parts

    def async_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs) -> AsyncRequest:
        """Stage and start the due tiers; see the class docstring. Collective.

        Raises:
            CheckpointingException: the iteration is neither set nor in ``checkpoint_dir``'s name.
        """
        step = self._step if self._step is not None else parse_step(checkpoint_dir)
        if step is None:
            raise CheckpointingException(
                f"tierckpt: cannot tell the iteration of {checkpoint_dir!r}; call set_step() first")
        self._step = None
        due = self.tiers.due(step)
        parts = self._parts(due, sharded_state_dict, checkpoint_dir)
        # Megatron names every save it starts as its latest checkpoint (tracker file) once
        # finalized: a deferred persistent step would be named without existing, so this path
        # waits for a running save instead (its exits are planned exits too)
        handle = self.tiers.save_parts(step, parts, wait_previous=True) if parts else SaveHandle(step, 0.0)
        self.last_delta, self.last_handle = handle.blocking_s, handle
        done = _Completion(self.tiers, handle)
        return AsyncRequest(wait_for_tiers, (done.reader, self.timeout_s),
                            [lambda: _finalize(done, handle, due, self.timeout_s)])


def _finalize(done: _Completion, handle: SaveHandle, due: list[str], timeout_s: float) -> None:
    """The commit point of one async save (Megatron writes its tracker file after this
    returns): only a persistent step the engine recorded as committed may count (no record =
    the stats gather failed too). A failed local tier is logged; training continues.

    Raises:
        TimeoutError: the tiers did not finish within ``timeout_s`` seconds (a caller that
            finalizes without running ``async_fn`` first waits here).
        CheckpointingException: the persistent tier was due and did not commit.
    """
    if not done.wait(timeout_s):
        raise TimeoutError(f"tierckpt: background save of step {handle.step} did not finish within {timeout_s}s")
    done.close()
    got = handle.outcome()
    out = {t: got.get(t) for t in due}
    failed = [t for t, ok in out.items() if ok is False]
    if "persistent" in due and out.get("persistent") is not True:
        raise CheckpointingException(f"tierckpt: persistent tier of step {handle.step} is not committed "
                                     f"({'failed' if 'persistent' in failed else 'no record'}; see the ledger)")
    if failed:
        log.warning("tierckpt mcore: step %d: %s tier failed; training continues", handle.step, ", ".join(failed))


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


# --------------------------------------------------------------------------- load strategy
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
        """Forwarded to the wrapped strategy (a ``torch_dist`` one through
        :func:`mcore_plugin.metadata.tensors_metadata`, which works around megatron-core's
        ``torch.empty(**properties.__dict__)`` on torch 2.15)."""
        if isinstance(self.base_strategy, TorchDistLoadShardedStrategy):
            return metadata.tensors_metadata(self.base_strategy, checkpoint_dir, *args, **kwargs)
        return self.base_strategy.load_tensors_metadata(checkpoint_dir, *args, **kwargs)

    def load_sharded_metadata(self, checkpoint_dir, *args, **kwargs):
        """Forwarded to the wrapped strategy (a ``torch_dist`` one through
        :func:`mcore_plugin.metadata.sharded_metadata`, as above)."""
        if isinstance(self.base_strategy, TorchDistLoadShardedStrategy):
            return metadata.sharded_metadata(self.base_strategy, checkpoint_dir, *args, **kwargs)
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
