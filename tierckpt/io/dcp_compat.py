"""The parts of torch.distributed.checkpoint (DCP) tierckpt uses beyond its documented API,
checked once per process when this module is imported.

tierckpt's staging, planners and readers lean on DCP internals: private modules
(``_fsspec_filesystem`` before torch 2.15, ``_nested_dict``, ``_state_dict_stager``, …), private helpers
(``_create_chunk_list``, ``_validate_global_plan``), planner methods it overrides or calls
(``DefaultSavePlanner._create_global_plan``), dataclass fields it reads or rebuilds
(``_StorageInfo.offset``, ``ReadItem.storage_offsets``) and attributes DCP's readers and writers
set in ``__init__`` that tierckpt swaps (``FileSystemReader.fs``, ``.storage_data``). None of
these is promised between torch releases; a rename would otherwise surface as an
``ImportError`` at a random import or an ``AttributeError`` in the middle of a save.

:data:`NEEDS` lists each of them with what uses it; :func:`check` resolves every one and raises
:class:`~tierckpt.errors.DCPInternalsChanged` naming the missing names, the torch version and
the tested range (:data:`TESTED_TORCH`). The check runs at this module's import; every tierckpt
module that uses a DCP internal imports it from here (the private names are re-exported below),
so importing the engine (``tierckpt.TieredCheckpointer``, the adapters) runs it before any
other DCP-using module. ``import tierckpt`` alone stays free of torch.distributed (its names
resolve lazily). Cost: under 1 ms once DCP is imported (attribute look-ups and two readers and
a writer built on a path, without touching the disk).

Not listed: ``torch.serialization._load`` (:mod:`tierckpt.io.memory_read`'s in-place decoder),
which has its own fallback to ``torch.load``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import inspect
from dataclasses import dataclass

import torch

from tierckpt.errors import DCPInternalsChanged

#: torch releases tierckpt is tested on (README, "Supported versions"), for the error message
TESTED_TORCH = "2.13.x to 2.15.x"

_CP = "torch.distributed.checkpoint"
# torch 2.15 made ``_fsspec_filesystem`` public as ``fsspec_filesystem`` (the old name warns that it
# will be removed); torch 2.13 has only the private one
_FSSPEC = (f"{_CP}.fsspec_filesystem" if importlib.util.find_spec(f"{_CP}.fsspec_filesystem") is not None
           else f"{_CP}._fsspec_filesystem")


@dataclass(frozen=True)
class Need:
    """One name tierckpt takes from DCP.

    Attributes:
        module: the module that defines it, e.g. ``"torch.distributed.checkpoint.filesystem"``.
        name: the attribute path inside the module (``"DefaultSavePlanner._dedup_save_plans"``,
            ``"LoadItemType.BYTE_IO"``).
        used_by: which part of tierckpt relies on it (for the error message).
        fields: dataclass fields (or enum members) read, set or passed by name.
        params: parameters passed by name to the function or constructor.
        members: attributes an instance gets in ``__init__``; checked on an instance built from
            ``build`` (positional arguments), which must not touch the disk or the network.
        build: the constructor's arguments for ``members``.
    """

    module: str
    name: str
    used_by: str
    fields: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    build: tuple = ()


_RESTORE = "restore (chunk map, in-cluster and memory readers)"
_PLANNER = "save and load planners (tierckpt.io.planner)"
_PATH = "/nonexistent/tierckpt-dcp-compat"  # never created: DCP's local readers and writers only store it

#: every DCP name tierckpt relies on beyond DCP's documented API (see the module docstring)
NEEDS: tuple[Need, ...] = (
    Need(f"{_CP}.filesystem", "_StorageInfo", _RESTORE, fields=("relative_path", "offset", "length")),
    Need(f"{_CP}.filesystem", "FileSystem", "bounded, hashing and memory-first file systems (tierckpt.io)"),
    *(Need(f"{_CP}.filesystem", f"FileSystem.{m}", "bounded, hashing and memory-first file systems (tierckpt.io)")
      for m in ("create_stream", "concat_path", "mkdir", "rename", "init_path")),
    Need(f"{_CP}.filesystem", "FileSystemReader", "readers (bounded file system, byte counts, in-cluster sources)",
         members=("fs", "path", "storage_data"), build=(_PATH,)),
    Need(f"{_CP}.filesystem", "FileSystemReader.read_data", "readers (bytes-read counts, memory-first reads)"),
    Need(f"{_CP}.filesystem", "FileSystemWriter", "hashing writer of the local tier (tierckpt.io.dcp_io)",
         members=("fs", "path", "single_file_per_rank", "thread_count", "sync_files", "transforms",
                  "serialization_format"), build=(_PATH,)),
    Need(f"{_CP}.filesystem", "_StorageWriterTransforms.transform_save_stream", "hashing writer (tierckpt.io.dcp_io)"),
    Need(f"{_CP}.filesystem", "SerializationFormat", "hashing writer (tierckpt.io.dcp_io)", fields=("TORCH_SAVE",)),
    Need(f"{_CP}.filesystem", "DEFAULT_SUFFIX", "hashing writer (tierckpt.io.dcp_io)"),
    Need("torch.serialization", "_get_storage_alignment", "hashing writer's tensor templates (tierckpt.io.dcp_io)"),
    Need(_FSSPEC, "FsspecWriter", "persistent tier on fsspec URLs", params=("sync_files",)),
    Need(_FSSPEC, "FsspecReader", "persistent tier's reads of fsspec URLs"),
    Need(f"{_CP}.default_planner", "_validate_global_plan", _PLANNER),
    Need(f"{_CP}.default_planner", "create_default_global_save_plan", _PLANNER),
    Need(f"{_CP}.default_planner", "DefaultSavePlanner", _PLANNER, params=("enable_plan_caching",),
         members=("flatten_state_dict",)),
    *(Need(f"{_CP}.default_planner", f"DefaultSavePlanner.{m}", _PLANNER)
      for m in ("_create_global_plan", "_dedup_save_plans", "create_local_plan", "lookup_object", "transform_object")),
    Need(f"{_CP}.default_planner", "DefaultLoadPlanner", _PLANNER, members=("flatten_state_dict",)),
    Need(f"{_CP}.planner_helpers", "_create_chunk_list", f"{_PLANNER} and the restore's chunk map"),
    Need(f"{_CP}.planner", "SavePlan", _PLANNER, fields=("items", "storage_data", "planner_data", "usable")),
    Need(f"{_CP}.planner", "LoadPlan", _RESTORE, fields=("items", "storage_data", "planner_data")),
    Need(f"{_CP}.planner", "ReadItem", _RESTORE,
         fields=("type", "dest_index", "dest_offsets", "storage_index", "storage_offsets", "lengths")),
    Need(f"{_CP}.planner", "WriteItem", _PLANNER, fields=("index", "type", "tensor_data")),
    Need(f"{_CP}.planner", "WriteItemType", _PLANNER, fields=("SHARD", "TENSOR", "BYTE_IO")),
    Need(f"{_CP}.planner", "LoadItemType", _RESTORE, fields=("TENSOR", "BYTE_IO")),
    Need(f"{_CP}.metadata", "Metadata", f"{_PLANNER} and {_RESTORE}",
         fields=("state_dict_metadata", "planner_data", "storage_data")),
    Need(f"{_CP}.metadata", "MetadataIndex", _RESTORE, fields=("fqn", "offset", "index")),
    Need(f"{_CP}.metadata", "TensorStorageMetadata", _RESTORE, fields=("properties", "size", "chunks")),
    Need(f"{_CP}._nested_dict", "flatten_state_dict", "restore's template check (tierckpt.restore.template)"),
    Need(f"{_CP}._sharded_tensor_utils", "_flatten_sharded_tensors",
         "restore's template check (tierckpt.restore.template)"),
    Need(f"{_CP}.staging", "DefaultStager", "staging pool (tierckpt.staging.pool)"),
    Need(f"{_CP}.staging", "StagingOptions", "staging pool (tierckpt.staging.pool)",
         fields=("use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy")),
    Need(f"{_CP}._state_dict_stager", "StateDictStager", "staging of CUDA state on a side stream",
         params=("pin_memory", "share_memory")),
    Need(f"{_CP}._state_dict_stager", "StateDictStager.stage", "staging of CUDA state on a side stream"),
    Need("torch.distributed._shard._utils", "narrow_tensor_by_index", "memory-first reader (tierckpt.io.memory_read)"),
    Need("torch.distributed.tensor", "DTensor._local_tensor", "staging copy plan (tierckpt.staging.copy_plan)"),
    Need("torch.distributed.tensor", "DTensor._spec", "staging copy plan (tierckpt.staging.copy_plan)"),
    Need(f"{_CP}.utils", "_DistWrapper", "the local tier's plan-caching save (tierckpt.io.plan_cache)",
         params=("group", "use_dist", "coordinator_rank")),
    *(Need(f"{_CP}.utils", f"_DistWrapper.{m}", "the local tier's plan-caching save (tierckpt.io.plan_cache)")
      for m in ("reduce_scatter", "all_reduce")),
    Need("torch", "_foreach_copy_", "staging copy plan and overlapped staging (tierckpt.staging)"),
)


def _resolve(need: Need) -> object:
    obj: object = importlib.import_module(need.module)
    for part in need.name.split("."):
        obj = getattr(obj, part)
    return obj


def _problems(need: Need) -> list[str]:
    """The missing names of ``need`` (dotted, with their module), empty when all are there."""
    full = f"{need.module}.{need.name}"
    try:
        obj = _resolve(need)
    except (ImportError, AttributeError):
        return [full]
    out = []
    if need.fields:
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            have = set(obj.__members__)
        else:
            have = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        out += [f"{full}.{f}" for f in need.fields if f not in have]
    if need.params:
        try:
            have = set(inspect.signature(obj).parameters)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            have = set()
        out += [f"{full}({p}=)" for p in need.params if p not in have]
    if need.members:
        try:
            inst = obj(*need.build)  # type: ignore[operator]
            out += [f"{full}().{m}" for m in need.members if not hasattr(inst, m)]
        except Exception as e:  # a constructor that changed its arguments counts as changed
            out.append(f"{full}({', '.join(map(repr, need.build))}) [{type(e).__name__}: {e}]")
    return out


def check(needs: tuple[Need, ...] | None = None) -> None:
    """Resolve every name of ``needs`` (default :data:`NEEDS`) in the running torch.

    Raises:
        DCPInternalsChanged: one or more names are missing; ``missing`` lists them all, the
            message names the first, what uses it, ``torch.__version__`` and
            :data:`TESTED_TORCH`.
    """
    missing = [(name, need.used_by) for need in (NEEDS if needs is None else needs) for name in _problems(need)]
    if missing:
        raise DCPInternalsChanged(missing, torch.__version__, TESTED_TORCH)


check()

# the private names, re-exported for tierckpt's modules (imported from here, they come after the check)
from torch.distributed._shard._utils import narrow_tensor_by_index as narrow_tensor_by_index  # noqa: E402
try:  # torch >= 2.15
    from torch.distributed.checkpoint.fsspec_filesystem import (  # type: ignore[import-not-found, unused-ignore]
        FsspecReader as FsspecReader,
        FsspecWriter as FsspecWriter,
    )
except ImportError:  # torch 2.13 and 2.14
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as FsspecReader  # noqa: E402
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as FsspecWriter  # noqa: E402
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten_state_dict  # noqa: E402
from torch.distributed.checkpoint._sharded_tensor_utils import (  # noqa: E402
    _flatten_sharded_tensors as _flatten_sharded_tensors,
)
from torch.distributed.checkpoint._state_dict_stager import StateDictStager as StateDictStager  # noqa: E402
from torch.distributed.checkpoint.default_planner import _validate_global_plan as _validate_global_plan  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo as _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.utils import _DistWrapper as _DistWrapper  # noqa: E402
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list as _create_chunk_list  # noqa: E402
