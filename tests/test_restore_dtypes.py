"""Every dtype loads from every source, wherever its record lands in the file (issue 29 E.6).

A DCP data file holds ``torch.save`` records back to back; a record's data is 64-byte aligned
within the record only, so an odd-sized tensor before it leaves its data at any residue. The
memory path (:mod:`tierckpt.io.memory_read`) decodes records in place over the file's bytes,
and torch's kernels assume dtype alignment (complex128: SIGSEGV in ``copy_``). Checked:

- units: :func:`~tierckpt.io.memory_read.decode_record` of every dtype at every offset 0..31
  returns an aligned tensor equal to ``torch.load``'s, sharing the buffer when the data is
  aligned (zero-copy kept) and a copy otherwise; the template path too. The memory reader's
  :func:`~tierckpt.io.memory_read.copy_record` copies a misaligned record into its target
  once, as bytes (most records are misaligned: in torch 2.13 each ``torch.save`` record's length is
  41 bytes past a multiple of 64, and DCP writes them back to back), and a slice of one through an aligned copy;
- a state of every dtype torch has on CPU, each tensor after an odd-sized int8 neighbour
  (the saved files are checked to hold misaligned records of every multi-byte dtype), saved
  to every tier and restored from own-local, peer-replica and persistent, bitwise, and every
  rank exits 0 (a SIGSEGV is a negative exit code: the harness fails).

Left out, a checked list (:data:`EXCLUDED`; :func:`test_every_other_dtype_is_excluded_for_the_reason_given`
asserts that every dtype torch has is tested or listed, and that each listed one really fails
as its reason says, so a torch upgrade that lifts a limit fails that test and the list gets
shorter):

- ``bits1x8``, ``bits2x4``, ``bits4x2``, ``bits8``, ``bits16``: ``torch.save`` writes them, DCP
  cannot (its save planner sizes a record with ``torch.iinfo``, which refuses them);
- ``int1``–``int7``, ``uint1``–``uint7``: ``torch.save`` cannot ("dtype … is not recognized"),
  so neither can DCP;
- ``quint4x2``, ``quint2x4``: quantized tensors ``torch.quantize_per_tensor`` makes on CPU, which
  ``torch.save`` writes and DCP cannot;
- ``qint8``, ``quint8``, ``qint32``: torch makes them on CPU and DCP saves and loads them, but
  tierckpt's staged copy of a quantized tensor loses its quantizer (its save fails: "cannot call
  qscheme on UnknownQuantizer"): not supported by tierckpt yet.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests import scenarios_memory
from tests.harness import run_world
from tierckpt.io import layout, memory_read

DTYPES = [getattr(torch, n) for n in scenarios_memory.DTYPES if hasattr(torch, n)]

#: every dtype torch has that the tests here leave out: name -> what fails (see the docstring)
EXCLUDED = {
    **{n: "dcp" for n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16")},
    **{f"{u}int{i}": "torch.save" for u in ("", "u") for i in range(1, 8)},
    **{n: "dcp (quantized)" for n in ("quint4x2", "quint2x4")},
    **{n: "tierckpt staging (quantized)" for n in ("qint8", "quint8", "qint32")},
}


def _values(dt: torch.dtype, n: int = 7) -> torch.Tensor:
    size = torch.empty(0, dtype=dt).element_size()
    if dt == torch.bool:
        return torch.tensor([True, False, True, True, False, False, True][:n])
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).view(dt)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dt", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("templated", [False, True], ids=["parsed", "template"])
def test_decode_record_is_aligned_at_every_offset(dt, templated):
    t = _values(dt)
    rec = io.BytesIO()
    torch.save(t, rec)
    raw = torch.frombuffer(bytearray(rec.getvalue()), dtype=torch.uint8)
    size = t.element_size()
    for off in range(32):
        memory_read._TEMPLATES.clear()
        buf = torch.zeros(raw.numel() + 64, dtype=torch.uint8)  # 64-byte aligned (torch's allocator)
        buf[off: off + raw.numel()] = raw
        record = buf[off: off + raw.numel()]
        if templated:  # a record of the same layout decoded before: this one is built from the template
            memory_read.decode_record(torch.frombuffer(bytearray(rec.getvalue()), dtype=torch.uint8))
            assert memory_read._TEMPLATES, "no template learnt"
        got = memory_read.decode_record(record)
        # checked before any kernel reads it: a misaligned complex128 crashes the process
        assert got.data_ptr() % size == 0, f"{dt} at offset {off}: data at address ≡ {got.data_ptr() % size} mod {size}"
        assert got.dtype == dt and got.shape == t.shape and _bytes(got) == _bytes(t), (dt, off)
        inside = buf.data_ptr() <= got.data_ptr() < buf.data_ptr() + buf.numel()
        data_aligned = (buf.data_ptr() + off + _data_offset(rec.getvalue())) % size == 0
        assert inside == data_aligned, f"{dt} at offset {off}: zero-copy {inside}, aligned data {data_aligned}"


@pytest.mark.parametrize("dt", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_copy_record_copies_a_misaligned_record_once_and_any_slice_of_it(dt, monkeypatch):
    # the memory reader's copy into the target: a whole record of the target's dtype is copied
    # as bytes (no realigning copy first), a slice of it (a resharded read) through an aligned copy
    t = _values(dt)
    rec = io.BytesIO()
    torch.save(t, rec)
    raw = torch.frombuffer(bytearray(rec.getvalue()), dtype=torch.uint8)
    realign = memory_read._realigned
    for off in range(17):
        buf = torch.zeros(raw.numel() + 64, dtype=torch.uint8)
        buf[off: off + raw.numel()] = raw
        src = memory_read.decode_in_place(buf[off: off + raw.numel()])
        target = torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8).view(dt)
        monkeypatch.setattr(memory_read, "_realigned", lambda x: pytest.fail("realigned a whole record"))
        memory_read.copy_record(target, src)
        assert _bytes(target) == _bytes(t), (dt, off)
        monkeypatch.setattr(memory_read, "_realigned", realign)
        part = torch.zeros(3 * t.element_size(), dtype=torch.uint8).view(dt)
        memory_read.copy_record(part, src[2:5])
        assert _bytes(part) == _bytes(t[2:5]), (dt, off)
        strided = torch.zeros(6 * t.element_size(), dtype=torch.uint8).view(dt)[::2]  # a non-contiguous target
        memory_read.copy_record(strided, src[:3])
        assert _bytes(strided) == _bytes(t[:3]), (dt, off)


def _data_offset(record: bytes) -> int:
    """Offset of a one-tensor ``torch.save`` record's data within the record."""
    reader = torch._C.PyTorchFileReader(io.BytesIO(record))
    name = next(n for n in reader.get_all_records() if n.endswith("data/0"))
    return reader.get_record_offset(name)


def _misaligned_dtypes(step_dir: str) -> set[str]:
    """The dtypes of the records of ``step_dir`` whose data sits at a file offset not divisible
    by their element size (what this test is about: such records must exist)."""
    reader = FileSystemReader(step_dir)
    md = reader.read_metadata()
    out = set()
    for idx, info in md.storage_data.items():
        tmd = md.state_dict_metadata[idx.fqn]
        dt = getattr(tmd, "properties", None)
        if dt is None:
            continue
        dt = dt.dtype
        with open(os.path.join(step_dir, info.relative_path), "rb") as f:
            f.seek(info.offset)
            rec = f.read(info.length)
        if (info.offset + _data_offset(rec)) % torch.empty(0, dtype=dt).element_size():
            out.add(str(dt))
    return out


def test_every_dtype_after_odd_neighbours_restores_from_every_source(tmp_path):
    base = str(tmp_path)
    out = run_world(scenarios_memory.phase_every_dtype_every_source, 2, base, timeout=400)
    for r in out:
        assert r.exitcode == 0
        assert r.value["sources"] == [("own-local", "own-local"), ("own-local", "peer-replica"),
                                      ("own-local", "persistent")], r.value
        assert r.value["dtypes"] == sorted(str(d) for d in DTYPES), r.value
    multi = {str(d) for d in DTYPES if torch.empty(0, dtype=d).element_size() > 1}
    for step_dir in (os.path.join(base, "nvme", "node-0", layout.local_step(1)),
                     os.path.join(base, "pfs", layout.persistent_step(1))):
        assert multi <= _misaligned_dtypes(step_dir), f"{step_dir}: some dtype never sits misaligned"


def _torch_dtypes() -> set[str]:
    """The name of every dtype torch has (aliases such as ``torch.float`` counted once)."""
    return {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _quantized(dt: torch.dtype) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.1, 0 if dt in (torch.qint8, torch.qint32) else 3, dt)


def _dcp_save(tensor: torch.Tensor, path: str) -> None:
    from torch.distributed.checkpoint import save

    save({"x": tensor}, checkpoint_id=path, no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning",
                            "ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("name", sorted(EXCLUDED))
def test_every_other_dtype_is_excluded_for_the_reason_given(name, tmp_path):
    """Every dtype torch has is tested above or listed in :data:`EXCLUDED`, and the listed one
    really fails where the list says: a torch (or tierckpt) that lifts the limit fails here,
    and the dtype moves to ``scenarios_memory.DTYPES``."""
    tested = {str(d).removeprefix("torch.") for d in DTYPES}
    assert _torch_dtypes() == tested | set(EXCLUDED), (
        f"not tested and not excluded: {sorted(_torch_dtypes() - tested - set(EXCLUDED))}; "
        f"excluded but unknown to torch: {sorted(set(EXCLUDED) - _torch_dtypes())}")
    assert not tested & set(EXCLUDED)
    dt, why = getattr(torch, name), EXCLUDED[name]
    if why == "torch.save":
        with pytest.raises(KeyError, match="is not recognized"):
            torch.save(torch.empty(4, dtype=dt), io.BytesIO())
        return
    t = _quantized(dt) if "quantized" in why else torch.zeros(4, dtype=dt)
    torch.save(t, io.BytesIO())  # torch itself writes it
    if why.startswith("dcp"):
        with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
            _dcp_save(t, str(tmp_path / "dcp"))
        assert type(e.value).__name__ == "CheckpointException", e.value
        return
    assert why == "tierckpt staging (quantized)", why
    _dcp_save(t, str(tmp_path / "dcp"))  # plain DCP saves it
    from tierckpt.staging.pool import StagingPool

    pool = StagingPool(1)
    try:
        slot, staged = pool.stage({"pad": torch.ones(3, dtype=torch.int8), "x": t}, users=1)
        with pytest.raises(RuntimeError, match="UnknownQuantizer"):  # the staged copy lost its quantizer
            torch.save(staged["x"], io.BytesIO())
        slot.release()
    finally:
        pool.close()
