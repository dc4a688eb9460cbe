"""Loading a node-local checkpoint whose files are (partly) in memory: what a restore does with
the files a pull just received and verified. The memory copy must be what is read (not the
disk), files not in memory come from disk, and the bytes are not copied first."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierckpt.io.memory_read import MemoryFirstFileSystem, TensorStream as _TensorStream
from tierckpt.tiers.local_tier import load_dir


@pytest.fixture(autouse=True)
def _one_rank(tmp_path):
    """A 1-rank gloo group for the load, torn down after each test (the pytest process is
    shared with other tests)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(path: str, sd: dict) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))


def _files(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    return out


def test_files_in_memory_are_read_from_memory_not_disk(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _save(a, {"w": torch.arange(10.0), "n": torch.tensor(3)})
    _save(b, {"w": torch.arange(10.0) * -1, "n": torch.tensor(4)})
    # memory says "b", the disk says "a": the load must return b's values
    target = {"w": torch.zeros(10), "n": torch.tensor(0)}
    read = _load(target, a, _files(b))
    assert torch.equal(target["w"], torch.arange(10.0) * -1) and target["n"].item() == 4
    assert read > 0


def test_files_missing_from_memory_come_from_disk(tmp_path):
    a = str(tmp_path / "a")
    _save(a, {"w": torch.arange(6.0).view(2, 3), "s": "text"})
    mem = {k: v for k, v in _files(a).items() if k == ".metadata"}  # only the metadata
    target = {"w": torch.zeros(2, 3), "s": ""}
    _load(target, a, mem)
    assert torch.equal(target["w"], torch.arange(6.0).view(2, 3)) and target["s"] == "text"


def test_tensor_stream_reads_seeks_and_shares_memory():
    buf = torch.arange(100, dtype=torch.uint8)
    s = _TensorStream(buf)
    assert s.read(3) == bytes([0, 1, 2])
    s.seek(-2, os.SEEK_END)
    assert s.read(10) == bytes([98, 99]) and s.read(1) == b""
    s.seek(50)
    buf[50] = 7  # no copy was taken: the stream sees the tensor's bytes
    assert s.read(1) == bytes([7]) and s.tell() == 51
    assert MemoryFirstFileSystem("/x", {}).files == {}


def _load(target: dict, path: str, memory: dict[str, torch.Tensor]) -> int:
    return load_dir(target, path, dist.group.WORLD, memory=memory)
