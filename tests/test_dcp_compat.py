"""The DCP internals check (:mod:`tierckpt.io.dcp_compat`, issue 33).

Every name of ``NEEDS`` resolves on the running torch (2.13 in ``.venv``, 2.15 in
``.venv-latest``); one taken away (a module attribute, a dataclass field, a parameter, an
attribute a reader sets in ``__init__``) gives :class:`~tierckpt.errors.DCPInternalsChanged`
naming it, what uses it and the torch version; and the engine's import runs the check before
any other tierckpt module touches DCP, so a missing private name is reported by that error,
not by an ``ImportError`` of whichever module imported it first.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.planner as dcp_planner

from tierckpt.errors import DCPInternalsChanged, TierckptError
from tierckpt.io import dcp_compat


def test_every_need_resolves_and_the_reexports_are_dcps_own_objects():
    dcp_compat.check()
    assert len(dcp_compat.NEEDS) >= 30
    assert dcp_compat._StorageInfo is dcp_fs._StorageInfo
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    assert dcp_compat._create_chunk_list is _create_chunk_list
    assert dcp_compat.FsspecReader.__module__ == dcp_compat._FSSPEC


def _raised() -> DCPInternalsChanged:
    with pytest.raises(DCPInternalsChanged) as e:
        dcp_compat.check()
    return e.value


def test_a_missing_private_name_is_named_with_its_user_and_the_torch_version(monkeypatch):
    monkeypatch.delattr(dcp_fs, "_StorageInfo")
    e = _raised()
    assert e.missing == ["torch.distributed.checkpoint.filesystem._StorageInfo"]
    assert e.torch_version == torch.__version__
    msg = str(e)
    assert "torch.distributed.checkpoint.filesystem._StorageInfo" in msg and f"torch {torch.__version__}" in msg
    assert "restore (chunk map, in-cluster and memory readers)" in msg and dcp_compat.TESTED_TORCH in msg
    assert isinstance(e, TierckptError) and isinstance(e, ImportError)


def test_a_missing_field_parameter_and_reader_attribute_are_each_named(monkeypatch):
    fields = [(f.name, f.type) for f in dataclasses.fields(dcp_planner.ReadItem) if f.name != "storage_offsets"]
    monkeypatch.setattr(dcp_planner, "ReadItem", dataclasses.make_dataclass("ReadItem", fields))
    real_init = dcp_fs.FileSystemReader.__init__

    def init_without_storage_data(self, *a, **kw):
        real_init(self, *a, **kw)
        del self.storage_data

    monkeypatch.setattr(dcp_fs.FileSystemReader, "__init__", init_without_storage_data)
    from torch.distributed.checkpoint import _state_dict_stager

    monkeypatch.setattr(_state_dict_stager, "StateDictStager", lambda pin_memory=False: None)
    e = _raised()
    assert e.missing == [
        "torch.distributed.checkpoint.filesystem.FileSystemReader().storage_data",
        "torch.distributed.checkpoint.planner.ReadItem.storage_offsets",
        "torch.distributed.checkpoint._state_dict_stager.StateDictStager(share_memory=)",
        "torch.distributed.checkpoint._state_dict_stager.StateDictStager.stage",
    ], e.missing
    assert "(and 3 more: " in str(e)


def test_importing_the_engine_runs_the_check_before_any_dcp_private_import():
    """In a fresh process without ``_create_chunk_list``: ``import tierckpt`` stays light and
    works; importing the engine raises DCPInternalsChanged (an ImportError) naming it."""
    code = textwrap.dedent("""
        import sys
        import tierckpt
        assert "torch.distributed" not in sys.modules
        import torch.distributed.checkpoint.planner_helpers as h
        del h._create_chunk_list
        from tierckpt.errors import DCPInternalsChanged
        try:
            import tierckpt.engine
        except DCPInternalsChanged as e:
            print("RAISED", e.missing)
        else:
            print("NOT RAISED")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAISED ['torch.distributed.checkpoint.planner_helpers._create_chunk_list']" in r.stdout, r.stdout
