"""The in-cluster restore's DCP reads of a node's copy (tierckpt/restore/cluster.py:
NodeCopies.reader) are bounded by restore_read_timeout_s like its verification: a file that
hangs between the two (a FIFO stands in for a hung NFS/NVMe read) raises ReadTimeout, which the
reader and the sender thread count as a bad copy, within the bound."""

from __future__ import annotations

import os
import time

import pytest

from tierckpt.errors import ReadTimeout
from tierckpt.io.storage import Store
from tierckpt.restore.cluster import NodeCopies


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO to stand in for a hung read (POSIX)")
def test_a_copy_read_that_hangs_times_out_within_the_bound(tmp_path):
    step = tmp_path / "local" / "step-5"
    step.mkdir(parents=True)
    os.mkfifo(step / "__0_0.distcp")  # opening it for reading blocks until a writer comes: never
    copies = NodeCopies(Store(str(tmp_path)), {0: "local/step-5"}, node=1, timeout_s=1.0)
    reader = copies.reader(0, {})
    t0 = time.monotonic()
    with pytest.raises(ReadTimeout):
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, "__0_0.distcp"), "rb") as f:
            f.read(16)
    assert time.monotonic() - t0 < 30
    unbounded = NodeCopies(Store(str(tmp_path)), {0: "local/step-5"}, node=1).reader(0, {})
    assert type(unbounded.fs).__name__ == "FileSystem"  # None keeps DCP's own (the check can fail)
