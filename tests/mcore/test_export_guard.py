"""export-mcore never converts a tierckpt step that is torn or fails verification."""

from __future__ import annotations

import json

import pytest

from mcore_plugin.export import ExportError, _check_tierckpt_commit, export
from tierckpt.io import manifest
from tierckpt.io.layout import INPROGRESS
from tierckpt.io.storage import Store


def _fake_step(root, name="step-5"):
    d = root / name
    d.mkdir()
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    return d


def test_torn_tierckpt_step_is_refused(tmp_path):
    d = _fake_step(tmp_path)
    (d / INPROGRESS).write_text("{}")
    with pytest.raises(ExportError, match="not committed"):
        export(str(d), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _commit(tmp_path):
    store = Store(str(tmp_path))
    entries = []
    for f in manifest.data_files(store, "step-5"):
        e = manifest.hash_file(store, f"step-5/{f}")
        entries.append(manifest.FileEntry(f, e.size, e.xxh3_64))  # paths are step-relative
    manifest.commit(store, "step-5", entries, step=5)


def test_committed_step_passes_the_guard(tmp_path):
    d = _fake_step(tmp_path)
    _commit(tmp_path)
    _check_tierckpt_commit(str(d))  # no error; the export itself then reads the checkpoint


def test_corrupt_committed_step_is_refused(tmp_path):
    d = _fake_step(tmp_path)
    _commit(tmp_path)
    (d / "__0_0.distcp").write_bytes(b"y" * 100)  # same size, other bytes
    with pytest.raises(ExportError, match="fails verification") as e:
        export(str(d), str(tmp_path / "out"))
    assert "__0_0.distcp" in str(e.value) and "missing" not in str(e.value)
