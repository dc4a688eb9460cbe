"""The restore's memory path (tierckpt/io/memory_read.py, tierckpt/restore/pull.py):

- units: rank-affine shares, the zero-copy decode of DCP's tensor records (equal to
  ``torch.load`` for every dtype/layout, sharing the buffer; the fallback equal too), the one-pass
  read + checksum of an own copy, a strict load refusing the disk, the config check;
- a node that lost its root is restored from its peer's replica loaded from memory (no
  fallback), and after the background job its own copy of the step is committed and intact
  and the replica rebuild reports full redundancy — 2 nodes × 1 and × 2 ranks;
- with ``restore_memory_bytes = 0`` the pull is committed first and loaded from disk;
- a replica corrupt in its data is loaded while it arrives, refused once the checksums settle,
  and the node restored from the next source (persistent), bitwise;
- a receiving rank whose load needs a file it does not hold in memory (2 ranks per node under
  FSDP: DCP wrote each replicated item into one rank's file; or, forced, ``.metadata``) makes
  the node fall back, agreed, to committing the pull and loading from disk — same state;
- a node restoring its own copy loads from the mappings while the checksums run (the load
  starts before the hash), and a flipped bit in its data voids the copy on every rank — loaded
  while checked, or (``restore_memory_bytes = 0``) checked first and never decoded — and the
  node is restored from its replica, bitwise; with 2 ranks per node reading their shares the
  two ways, a bad share on either or an I/O error while checking one voids the copy on both
  ranks through the same collectives (no hang).
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests import scenarios, scenarios_memory
from tests.harness import run_world
from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.io import memory_read
from tierckpt.io.manifest import FileEntry, hash_file, rank_of_file, split_share
from tierckpt.io.storage import Store
from tierckpt.tiers.local_tier import load_dir

K, EXTRA = 2, 2


# -- units ------------------------------------------------------------------------------------
def test_split_share_is_rank_affine_and_covers_every_file_once():
    names = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
             "common.pt", "sub/__1_0.distcp"]
    entries = [FileEntry(n, 1, "0") for n in names]
    shares = [split_share(entries, i, 3) for i in range(3)]
    assert sorted(e.path for s in shares for e in s) == sorted(names)  # each file exactly once
    assert {e.path for e in shares[0]} >= {"__0_0.distcp", "__0_1.distcp"}
    assert {e.path for e in shares[1]} >= {"__1_0.distcp", "sub/__1_0.distcp"}
    assert "__2_0.distcp" in {e.path for e in shares[2]}
    # a rank beyond the count (a job with more ranks per node) is spread round-robin
    assert rank_of_file("__3_0.distcp") == 3 and rank_of_file(".metadata") is None
    with pytest.raises(ValueError):
        split_share(entries, 3, 3)


def _record(t: torch.Tensor) -> torch.Tensor:
    b = io.BytesIO()
    torch.save(t, b)
    return torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("tensor", [
    torch.randn(17, 5), torch.randn(6, 4).t(), torch.arange(10, dtype=torch.int64), torch.tensor(3.5),
    torch.randn(8).to(torch.bfloat16), torch.tensor([True, False]), torch.empty(0, 3),
], ids=["fp32", "transposed", "int64", "scalar", "bf16", "bool", "empty"])
def test_decode_record_equals_torch_load_and_shares_the_buffer(tensor):
    buf = _record(tensor)
    # as DCP stores it: one record at some offset inside a bigger file (one that keeps the data
    # aligned for every dtype; misaligned ones are copied: tests/test_restore_dtypes.py)
    file = torch.cat([torch.zeros(64, dtype=torch.uint8), buf, torch.zeros(7, dtype=torch.uint8)])
    got = memory_read.decode_record(file[64: 64 + buf.numel()])
    ref = torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=True)
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.stride() == ref.stride()
    assert torch.equal(got, ref)
    if tensor.numel():
        lo = file.data_ptr()
        assert lo <= got.untyped_storage().data_ptr() < lo + file.numel(), "the data was copied"


def test_decode_record_fallback_is_equal(monkeypatch):
    t = torch.randn(9, 3)
    monkeypatch.setattr(memory_read, "_fast_ok", False)
    assert torch.equal(memory_read.decode_record(_record(t)), t)


def test_read_verified_maps_intact_files_and_names_every_problem(tmp_path):
    store = Store(str(tmp_path))
    data = {"a.bin": os.urandom(5000), "b.bin": os.urandom(100), "c.bin": os.urandom(10), "e.bin": b""}

    def write(name, b):
        with open(store.path(f"s/{name}"), "wb") as f:
            f.write(b)

    os.makedirs(store.path("s"))
    for name, b in data.items():
        write(name, b)
    entries = [FileEntry(n, hash_file(store, f"s/{n}").size, hash_file(store, f"s/{n}").xxh3_64) for n in data]
    mem, problems = memory_read.read_verified(store, "s", entries)
    assert problems == [] and {n: bytes(t.numpy()) for n, t in mem.items()} == data
    raw = bytearray(data["a.bin"])
    raw[4000] ^= 1
    write("a.bin", bytes(raw))  # a flipped bit
    write("b.bin", data["b.bin"] + b"x")  # grew
    os.remove(store.path("s/c.bin"))  # gone
    mem, problems = memory_read.read_verified(store, "s", entries)
    assert sorted(mem) == ["e.bin"]
    assert len(problems) == 3 and "xxh3_64" in problems[0] and "size 101" in problems[1] and "missing" in problems[2]


def test_strict_memory_load_reads_nothing_from_disk(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        path = str(tmp_path / "ck")
        dcp.save({"w": torch.arange(8.0)}, storage_writer=dcp.FileSystemWriter(path))
        files = {n: torch.frombuffer(bytearray(open(os.path.join(path, n), "rb").read()), dtype=torch.uint8)
                 for n in os.listdir(path)}
        target = {"w": torch.zeros(8)}
        load_dir(target, path, dist.group.WORLD, memory=files, strict=True)
        assert torch.equal(target["w"], torch.arange(8.0))
        data = {n: t for n, t in files.items() if n != ".metadata"}
        with pytest.raises(CheckpointException, match="NotInMemoryError|not among the files"):
            load_dir({"w": torch.zeros(8)}, path, dist.group.WORLD, memory=data, strict=True)
    finally:
        dist.destroy_process_group()


def test_restore_memory_bytes_is_checked(tmp_path):
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="restore_memory_bytes"):
            TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"),
                       restore_memory_bytes=bad)


# -- node loss, restored from the peer's replica ------------------------------------------------
@pytest.fixture(scope="module", params=[1, 2], ids=["2nodes-x1rank", "2nodes-x2ranks"])
def saved(request, tmp_path_factory):
    rpn = request.param
    base = str(tmp_path_factory.mktemp(f"memrestore{rpn}"))
    run_world(scenarios.phase_train_and_save, 2 * rpn, base, rpn, K, EXTRA, {"tiers": ("local",)})
    return base, rpn


def _lose_node_1(saved, tmp_path) -> str:
    base = str(tmp_path / "run")
    shutil.copytree(saved, base)
    shutil.rmtree(os.path.join(base, "nvme", "node-1"))
    return base


def _check(out, rpn, fallback: bool):
    for r in out:
        v = r.value
        assert v["sources"] == {0: ("own-local", 0), 1: ("peer-replica", 0)} and v["attempts"] == 1, v
        # the pulled copy is node 1's committed, intact local step once the background job ran
        assert v["own_copy"] == (r.rank // rpn, []) and not v["incoming_left"], v
        assert v["redundancy"] == (True, [0], []), v
    fell_back = sum(r.value["fallbacks"] for r in out if r.rank // rpn == 1)
    assert (fell_back == rpn) if fallback else fell_back == 0, [r.value["fallbacks"] for r in out]


def test_pulled_replica_loads_from_memory_and_commits_in_background(saved, tmp_path):
    base, rpn = saved
    out = run_world(scenarios_memory.phase_node_loss, 2 * rpn, _lose_node_1(base, tmp_path), rpn, K, EXTRA,
                    {"tiers": ("local",)})
    # one rank per node: its share is every file, the load is served from memory. Two: DCP's
    # save wrote each replicated (FSDP-unsharded) item once, into one rank's file, so each rank
    # of node 1 also reads a file the other received; the node falls back, agreed, to
    # committing the pull and loading from disk — the same state, bitwise
    _check(out, rpn, fallback=rpn > 1)


def test_restore_memory_bytes_zero_commits_first_and_loads_from_disk(saved, tmp_path):
    base, rpn = saved
    out = run_world(scenarios_memory.phase_node_loss, 2 * rpn, _lose_node_1(base, tmp_path), rpn, K, EXTRA,
                    {"tiers": ("local",), "restore_memory_bytes": 0})
    _check(out, rpn, fallback=False)


@pytest.mark.parametrize("saved", [1], indirect=True, ids=["2nodes-x1rank"])
def test_no_memory_for_the_pull_receives_it_to_disk(saved, tmp_path):
    # node 1's allocator refuses the pull's buffers: it receives to disk instead (the sender is
    # drained, not left waiting for the group timeout) and loads from there, with a warning
    base, rpn = saved
    out = run_world(scenarios_memory.phase_node_loss, 2 * rpn, _lose_node_1(base, tmp_path), rpn, K, EXTRA,
                    {"tiers": ("local",)}, False, True, timeout=240)
    _check(out, rpn, fallback=False)
    assert [r.value["no_memory"] for r in out] == [0, 1], out


@pytest.mark.parametrize("saved", [1], indirect=True, ids=["2nodes-x1rank"])
def test_a_file_missing_from_memory_falls_back_to_disk(saved, tmp_path):
    base, rpn = saved
    out = run_world(scenarios_memory.phase_node_loss, 2 * rpn, _lose_node_1(base, tmp_path), rpn, K, EXTRA,
                    {"tiers": ("local",)}, True)
    _check(out, rpn, fallback=True)


def _flip_a_data_bit(step_dir: str, name: str | None = None) -> None:
    """Flip one bit in the middle of data file ``name`` of ``step_dir`` (default: the first):
    in a tensor's data, not in a record header."""
    name = name or sorted(f for f in os.listdir(step_dir) if f.endswith(".distcp"))[0]
    victim = os.path.join(step_dir, name)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_replica_corrupt_in_its_data_is_loaded_then_refused_and_the_next_source_used(tmp_path):
    # the pulled bytes are loaded while they arrive; the checksum settles after the load, and a
    # mismatch voids it: the node is restored from the persistent tier, bitwise
    base = str(tmp_path)
    run_world(scenarios.phase_train_and_save, 2, base, 1, K, EXTRA)
    shutil.rmtree(os.path.join(base, "nvme", "node-1"))
    _flip_a_data_bit(os.path.join(base, "nvme", "node-0", "replicas", "node-1", f"step-{K}"))
    out = run_world(scenarios.phase_restore_and_check, 2, base, 1, K, EXTRA)[0].value
    assert out["sources"] == {0: ("own-local", 0), 1: ("persistent", None)}, out
    assert any(f[:3] == (1, "peer-replica", 0) and "checksum mismatch" in f[4] for f in out["failures"]), out


def test_decode_record_templates_never_mix_up_records():
    # records of one layout share every byte before their data: the second one is built from
    # the first one's template, with its own values; a same-length record of another dtype or
    # shape does not match the template
    memory_read._TEMPLATES.clear()
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    ints = torch.arange(35, dtype=torch.int32).view(5, 7)  # same byte length as a
    flat = torch.randn(35)
    for t in (a, b, ints, flat, a.t().contiguous().t()):
        got = memory_read.decode_record(_record(t))
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride() and torch.equal(got, t)
    assert any(len(v) > 1 for v in memory_read._TEMPLATES.values())  # one length, several layouts


# -- a node restoring its own copy ---------------------------------------------------------------
def _copy(saved, tmp_path) -> str:
    base = str(tmp_path / "run")
    shutil.copytree(saved[0], base)
    return base


@pytest.mark.parametrize("saved", [1], indirect=True, ids=["2nodes-x1rank"])
def test_own_copy_is_loaded_while_its_checksums_run(saved, tmp_path):
    # one pass over the disk: the load decodes from the mappings the checksum thread reads
    base = _copy(saved, tmp_path)
    out = run_world(scenarios_memory.phase_own_load_overlaps_check, 2, base, 1, K, EXTRA, {"tiers": ("local",)})
    for r in out:
        assert r.value["sources"] == {0: ("own-local", 0), 1: ("own-local", 1)}, r.value
        assert r.value["load_before_check"] == [True], r.value


@pytest.mark.parametrize("saved", [1], indirect=True, ids=["2nodes-x1rank"])
@pytest.mark.parametrize("memory_bytes", [None, 0], ids=["loaded-while-checked", "checked-first"])
def test_an_own_copy_corrupt_in_its_data_is_refused_and_the_replica_used(saved, tmp_path, memory_bytes):
    # loaded from its mappings while the checksums run (or, with restore_memory_bytes = 0,
    # checked from disk first and never decoded): a flipped bit voids node 0's own copy on
    # every rank, and node 0 is restored from its replica on node 1, bitwise
    base = _copy(saved, tmp_path)
    kw = {"tiers": ("local",)} | ({} if memory_bytes is None else {"restore_memory_bytes": memory_bytes})
    _flip_a_data_bit(os.path.join(base, "nvme", "node-0", "local", f"step-{K}"))
    out = run_world(scenarios_memory.phase_own_copy_read_two_ways, 2, base, 1, K, EXTRA, kw)[0].value
    assert out["sources"] == {0: ("peer-replica", 1), 1: ("own-local", 1)}, out
    assert [f[:4] for f in out["failures"]] == [(0, "own-local", 0, K)], out
    assert "VerificationError" in out["failures"][0][4] and "xxh3_64" in out["failures"][0][4], out
    # node 0 decoded its own copy (then refused it) only where it was loaded while checked;
    # then the replica, once
    assert out["reads"] == (2 if memory_bytes is None else 1), out


@pytest.mark.parametrize("saved", [2], indirect=True, ids=["2nodes-x2ranks"])
@pytest.mark.parametrize("case", ["bad-share-read-ahead", "bad-share-checked-first", "disk-error-checked-first"])
def test_ranks_of_a_node_reading_their_own_copy_differently_agree(saved, tmp_path, case):
    # 2 nodes x 2 ranks; on each node local rank 0 reads its share ahead (loaded while
    # checked), local rank 1 checksums from disk first (a share above restore_memory_bytes).
    # A bad share on either rank, or an I/O error on rank 1, voids node 0's own copy on both of
    # its ranks through the same collectives (no hang), and node 0 is restored from node 1
    base = _copy(saved, tmp_path)
    kw = {"tiers": ("local",)}
    own = os.path.join(base, "nvme", "node-0", "local", f"step-{K}")
    if case != "disk-error-checked-first":
        victim = 0 if case == "bad-share-read-ahead" else 1
        files = sorted(f for f in os.listdir(own) if f.endswith(".distcp") and rank_of_file(f) == victim)
        _flip_a_data_bit(own, files[0])
    out = run_world(scenarios_memory.phase_own_copy_read_two_ways, 4, base, 2, K, EXTRA, kw,
                    case == "disk-error-checked-first", timeout=240)
    for r in out:
        v = r.value
        assert v["sources"] == {0: ("peer-replica", 1), 1: ("own-local", 1)}, v
        assert [f[:4] for f in v["failures"]] == [(0, "own-local", 0, K)], v
        why = "Input/output error" if case == "disk-error-checked-first" else "xxh3_64"
        assert why in v["failures"][0][4], v
