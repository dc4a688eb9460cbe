"""``load_tensors_metadata`` / ``load_sharded_metadata`` of a ``torch_dist`` step on every
supported torch (used by :class:`~mcore_plugin.strategies.TieredLoadStrategy`).

megatron-core (0.16.1 to 0.19.2) builds each tensor's metadata as
``torch.empty(tp.size, **tp.properties.__dict__, device="meta")``. torch 2.15 added a
``strides`` field to DCP's ``TensorProperties``, which ``torch.empty`` does not take, so on
torch 2.15 Megatron's loaders raise ``TypeError: empty() got an unexpected keyword argument
'strides'`` for every checkpoint. Here Megatron's own loader gets the step's metadata with each
``properties`` reduced to the keywords ``torch.empty`` takes; on a torch without extra fields
the call is forwarded unchanged.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

#: the TensorProperties fields ``torch.empty`` takes as keywords
EMPTY_KEYWORDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

#: whether this torch's TensorProperties has fields ``torch.empty`` refuses (torch >= 2.15: ``strides``)
EXTRA_FIELDS = tuple(f.name for f in dataclasses.fields(TensorProperties) if f.name not in EMPTY_KEYWORDS)


def for_torch_empty(metadata: Any) -> Any:
    """A copy of the DCP ``Metadata`` whose tensors' ``properties`` hold only
    :data:`EMPTY_KEYWORDS` (plain namespaces: Megatron reads them through ``__dict__``);
    ``metadata`` itself is not changed."""
    sd = {}
    for k, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            props = types.SimpleNamespace(**{n: getattr(md.properties, n) for n in EMPTY_KEYWORDS})
            md = dataclasses.replace(md, properties=props)  # type: ignore[arg-type]
        sd[k] = md
    return dataclasses.replace(metadata, state_dict_metadata=sd)


def read_metadata(checkpoint_dir: Any) -> Any:
    """The DCP ``Metadata`` of ``checkpoint_dir``, read by Megatron's own reader (which follows
    its multi-storage-client setting)."""
    from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader

    return _get_filesystem_reader(checkpoint_dir).read_metadata()


def tensors_metadata(base: Any, checkpoint_dir: Any, metadata: Any = None) -> dict:
    """``base.load_tensors_metadata(checkpoint_dir, metadata)`` (``base``: Megatron's
    ``TorchDistLoadShardedStrategy``) on any supported torch: {key: ShardedTensor without data}."""
    if not EXTRA_FIELDS:
        return base.load_tensors_metadata(checkpoint_dir, metadata)
    return base.load_tensors_metadata(checkpoint_dir, for_torch_empty(metadata or read_metadata(checkpoint_dir)))


def sharded_metadata(base: Any, checkpoint_dir: Any) -> dict:
    """``base.load_sharded_metadata(checkpoint_dir)`` on any supported torch: the step's
    objects (empty ``ShardedObject``) and tensors, keyed as Megatron keys them."""
    if not EXTRA_FIELDS:
        return base.load_sharded_metadata(checkpoint_dir)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = read_metadata(checkpoint_dir)
    out: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            obj = ShardedObject.empty_from_unique_key(key)
            out[obj.unique_key] = obj
    out.update(tensors_metadata(base, checkpoint_dir, metadata))
    return out
