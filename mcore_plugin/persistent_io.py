"""The persistent tier's framework hooks for Megatron-Core: ``torch_dist`` checkpoints.

``<persistent_root>/step-<N>/`` is a complete ``torch_dist`` checkpoint (``.metadata``,
``__<r>_<t>.distcp`` planned by Megatron's ``MCoreSavePlanner``, ``common.pt``,
``metadata.json``) plus tierckpt's manifest and commit marker, so stock
``megatron.core.dist_checkpointing.load`` reads it without this plugin. The tier writes,
hashes and commits; the hooks here only say what is written and how it is read back.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
)

from tierckpt import PersistentIO

from .convert import COMMON_FNAME, TOP_KEY, RestoreRequest, Staged, flat_copy, to_bytes, to_dcp


def config_bytes() -> bytes:
    """``metadata.json`` of a torch_dist v1 checkpoint, byte for byte what Megatron's
    ``save_config`` writes (``json.dump`` of the installed version's ``CheckpointingConfig``)."""
    return json.dumps(asdict(CheckpointingConfig("torch_dist", 1))).encode()


class MegatronPersistentIO(PersistentIO):
    """Persistent-tier hooks writing and reading ``torch_dist`` checkpoints (module docstring).

    Save: DCP files of the main replicas only (ShardedObjects written by their main replica's
    rank), planned by ``MCoreSavePlanner``; ``common.pt`` and ``metadata.json`` from rank 0 of
    the group. Load: into the template of the pending restore (built in the persistent
    optimizer format) with Megatron's shape validation and tierckpt's coverage/dtype check,
    over the node's ranks. State dicts that are not the plugin's (no :class:`Staged` or
    :class:`RestoreRequest` under the top-level key) use :class:`tierckpt.PersistentIO`'s
    plain DCP defaults.
    """

    def to_dcp(self, state_dict: dict, url: str, process_group):
        staged = _under_top(state_dict, Staged)
        if staged is None:
            return super().to_dcp(state_dict, url, process_group)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(staged.sharded, keep_only_main_replica=True)
        return to_dcp(flat_copy(flat), False, objects_as_bytes=False), MCoreSavePlanner(flatten_state_dict=False)

    def side_files(self, state_dict: dict, process_group) -> dict[str, bytes]:
        staged = _under_top(state_dict, Staged)
        if staged is None or dist.get_rank(process_group) != 0:
            return {}
        return {COMMON_FNAME: to_bytes(staged.common), CONFIG_FNAME: config_bytes()}

    def load_template(self, state_dict: dict, url: str, process_group):
        req = _under_top(state_dict, RestoreRequest)
        if req is None:
            return super().load_template(state_dict, url, process_group)
        return req.persistent_template()

    def after_load(self, state_dict: dict, loaded: dict, url: str, process_group) -> int:
        req = _under_top(state_dict, RestoreRequest)
        if req is None:
            return super().after_load(state_dict, loaded, url, process_group)
        return req.finish_persistent(loaded, url)


def _under_top(state_dict, cls):
    v = state_dict.get(TOP_KEY) if isinstance(state_dict, dict) else None
    return v if isinstance(v, cls) else None
