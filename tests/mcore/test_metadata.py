"""``mcore_plugin.metadata``: Megatron's ``load_tensors_metadata`` / ``load_sharded_metadata``
on a torch whose DCP ``TensorProperties`` has a field ``torch.empty`` refuses (torch 2.15's
``strides``; megatron-core passes ``**properties.__dict__`` to ``torch.empty``). On torch 2.13
the extra field is simulated on a real step's metadata; ``make test-latest`` runs the real one
(and tests/mcore/test_mcore_tiers.py's round trip calls both loaders on a tierckpt step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mcore_plugin import metadata


@pytest.fixture
def step(tmp_path):
    """A DCP step holding two tensors and an object."""
    sd = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.zeros(4), "obj/shard_0_1": ("k", 1)}  # an object, keyed as Megatron keys one
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    return str(tmp_path)


def _with_strides(md):
    """``md`` whose tensors' properties carry a ``strides`` entry, as torch 2.15's do."""
    sd = {}
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            props = dataclasses.replace(v.properties)
            props.__dict__["strides"] = tuple(torch.empty(v.size).stride())
            v = dataclasses.replace(v, properties=props)
        sd[k] = v
    return dataclasses.replace(md, state_dict_metadata=sd)


def test_megatrons_loader_refuses_strides_and_the_plugins_path_reads_them(step, monkeypatch):
    base = TorchDistLoadShardedStrategy()
    md = _with_strides(FileSystemReader(step).read_metadata())
    with pytest.raises(TypeError, match="strides"):
        base.load_tensors_metadata(step, md)
    monkeypatch.setattr(metadata, "EXTRA_FIELDS", ("strides",))
    got = metadata.tensors_metadata(base, step, md)
    assert set(got) == {"w", "b"}
    assert isinstance(got["w"], ShardedTensor) and got["w"].dtype == torch.bfloat16
    assert tuple(got["w"].global_shape) == (2, 3) and tuple(got["b"].global_shape) == (4,)
    assert "strides" in md.state_dict_metadata["w"].properties.__dict__  # the caller's metadata is untouched

    monkeypatch.setattr(metadata, "read_metadata", lambda d: md)
    full = metadata.sharded_metadata(base, step)
    objs = [v for v in full.values() if isinstance(v, ShardedObject)]
    assert [o.key for o in objs] == ["obj"] and {"w", "b"} <= set(full)


def test_on_this_torch_the_plugins_loaders_give_megatrons_keys(step):
    """Without extra fields (torch 2.13) the result is Megatron's own; with them (torch 2.15:
    ``strides``) Megatron's own call really fails and the plugin's gives every key."""
    base = TorchDistLoadShardedStrategy()
    got = metadata.sharded_metadata(base, step)
    assert {"w", "b"} <= set(got) and len(got) == 3
    if not metadata.EXTRA_FIELDS:
        assert set(got) == set(base.load_sharded_metadata(step))
        return
    assert metadata.EXTRA_FIELDS == ("strides",), metadata.EXTRA_FIELDS  # torch 2.15's one new field
    with pytest.raises(TypeError, match="strides"):
        base.load_sharded_metadata(step)
