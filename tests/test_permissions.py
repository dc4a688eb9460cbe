"""Permissions of node-local checkpoints (``TierConfig.local_permissions``).

Multi-process (gloo, 2 ranks as 2 nodes, replication F=2): after two saves, a wiped node's
restore pulled from its neighbour's replica and the replica rebuild, every directory under
each node-local root (the root included) and every file has exactly the setting's bits,
whatever the umask; the persistent tier's files are never wider than the umask allows. Unit
tests: the stores' creation paths, DCP's files created with the mode (no world-readable
window), ``write_atomic`` never widening a file it replaces, directories left by an earlier
run tightened at start, and the option's validation in TierConfig, the TOML front-end and
the Megatron flags.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile

import pytest
import torch.distributed as dist

from tests import scenarios
from tests.harness import run_world
from tierckpt.errors import ConfigError
from tierckpt.io import perms
from tierckpt.io.storage import Store

SHM = "/dev/shm"


@contextlib.contextmanager
def umask(mask: int):
    """The test process's umask set to ``mask`` for the block (the library never changes it)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def tree_modes(root: str) -> dict[str, int]:
    """{path relative to ``root`` ("." = the root): permission bits} of everything under it."""
    out = {".": mode(root)}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = mode(p)
    return out


# -- multi-process -----------------------------------------------------------------------------
def phase_save_pull_restore(rank, world, base, local_root, setting, mask):
    """Under umask ``mask``: save steps 1 and 2 (local + replica + persistent), wipe node 1's
    root, restore (node 1 pulls its step from node 0's replica), wait for the replica rebuild."""
    os.umask(mask)
    cfg = scenarios.make_config(base, local_root=local_root, local_permissions=setting, transfer_chunk_bytes=8192)
    eng = scenarios.TieredCheckpointer(cfg, node_id=rank)
    model, opt = scenarios.build(seed=0)
    for s in (1, 2):
        scenarios.train_step(model, opt, s, rank)
        eng.save(s, scenarios.app_state(model, opt))
        eng.wait()
    ref = scenarios.snapshot(model, opt)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local_root.format(node=1), ignore_errors=False)
    dist.barrier()
    m2, o2 = scenarios.build(seed=5)
    sd = scenarios.app_state(m2, o2)
    res = eng.restore(sd)
    scenarios.apply_state(m2, o2, sd)
    scenarios.assert_bitwise(scenarios.snapshot(m2, o2), ref)
    eng.wait()  # the replica rebuild after the restore
    eng.close()
    return {"step": res.step, "source1": res.source_of(1), "source0": res.source_of(0)}


@pytest.fixture
def shm_dir():
    """A fresh directory under /dev/shm (a RAM local root); only the cases that use it are
    skipped where the machine has no /dev/shm (a container without it, macOS)."""
    if not os.path.isdir(SHM):
        pytest.skip(f"{SHM} does not exist on this machine: the RAM-root (tmpfs) case needs it")
    d = tempfile.mkdtemp(prefix="tierckpt-test-perms-", dir=SHM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("where,setting,mask", [
    ("disk", "private", 0o022),  # the usual umask: DCP and tierckpt would make 0755 / 0644
    ("shm", "group", 0o077),  # a RAM root; the group bits the umask would clear are granted
], ids=["disk-private-umask022", "shm-group-umask077"])
def test_node_local_tree_has_exact_modes_after_save_replicate_pull(tmp_path, request, where, setting, mask):
    base = str(tmp_path)
    # only the RAM-root case needs /dev/shm: the disk case runs without it
    top = base if where == "disk" else request.getfixturevalue("shm_dir")
    local_root = os.path.join(top, "nvme", "node-{node}")
    res = run_world(phase_save_pull_restore, 2, base, local_root, setting, mask, timeout=300)
    assert res[0].value == {"step": 2, "source1": "peer-replica", "source0": "own-local"}, res[0].value
    want = perms.SETTINGS[setting]
    for n in (0, 1):
        root = local_root.format(node=n)
        modes = tree_modes(root)
        # the copies this test is about are there: own step, the replica of the other node, and
        # on node 1 the pulled step (the root itself was recreated by the pull)
        for rel in ("local/step-2/.metadata", "local/step-2/tierckpt.committed",
                    f"replicas/node-{1 - n}/step-2/tierckpt.manifest.json"):
            assert rel in modes, (n, rel, sorted(modes))
        assert any(r.endswith(".distcp") for r in modes), sorted(modes)
        wrong = {r: f"{m:04o}" for r, m in modes.items()
                 if m != (want.dir if os.path.isdir(os.path.join(root, r)) else want.file)}
        assert not wrong, f"node {n} ({setting}: dirs {want.dir:04o}, files {want.file:04o}): {wrong}"
    # the persistent tier keeps what the umask gives: never wider (under umask 077: 0700 / 0600)
    pfs = tree_modes(os.path.join(base, "pfs"))
    assert "tierckpt-ledger.jsonl" in pfs and "step-2/.metadata" in pfs, sorted(pfs)
    for r, m in pfs.items():
        allowed = (0o777 if os.path.isdir(os.path.join(base, "pfs", r)) else 0o666) & ~mask
        assert m & ~allowed == 0, (r, f"{m:04o}", f"umask {mask:03o}")
        if mask == 0o077:
            assert m == allowed, (r, f"{m:04o}")


# -- units -------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["private", "group"])
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_store_creates_exact_modes_whatever_the_umask(tmp_path, setting, mask):
    want = perms.SETTINGS[setting]
    root = tmp_path / "shared-prefix" / "root"
    with umask(mask):
        store = Store(str(root), perms.modes_of(setting))
        store.write_atomic("local/step-1/tierckpt.manifest.json", b"{}")
        with store.open("local/step-1/tierckpt.inprogress", "wb") as f:
            f.write(b"x")
        os.close(store.create_fd("replicas/node-3/step-1/__0_0.distcp", os.O_WRONLY | os.O_TRUNC))
        store.sub("local").makedirs(".incoming-step-1/sub")
        # an existing file rewritten with O_TRUNC is narrowed before any byte is written
        stale = root / "local" / "step-1" / "old.distcp"
        stale.write_bytes(b"")
        os.chmod(stale, 0o644)
        os.close(store.create_fd("local/step-1/old.distcp", os.O_WRONLY | os.O_TRUNC))
    modes = tree_modes(str(root))
    assert {r for r, m in modes.items() if m != (want.dir if os.path.isdir(root / r) else want.file)} == set(), modes
    assert mode(str(root.parent)) == 0o777 & ~mask  # a prefix above the root follows the umask


def test_dcp_files_are_created_private_not_chmod_later(tmp_path):
    """Inside DCP's stream (bytes not yet written) the file already has the local mode."""
    from tierckpt.io.dcp_io import hashing_writer

    seen = []
    with umask(0o022):
        w = hashing_writer(str(tmp_path / "root" / "local" / "step-1"), perms.modes_of("private"),
                           str(tmp_path / "root"))
        w.fs.mkdir(w.path)
        with w.fs.create_stream(w.fs.concat_path(w.path, "__0_0.distcp"), "wb") as s:
            seen.append(stat.S_IMODE(os.fstat(s.fileno()).st_mode))
            s.write(b"payload")
        plain = hashing_writer(str(tmp_path / "pfs" / "step-1"))  # the persistent tier: the umask's bits
        plain.fs.mkdir(plain.path)
        with plain.fs.create_stream(plain.fs.concat_path(plain.path, "__0_0.distcp"), "wb") as s:
            s.write(b"payload")
    assert seen == [0o600]
    assert mode(str(tmp_path / "root")) == 0o700 and mode(str(tmp_path / "root" / "local" / "step-1")) == 0o700
    assert mode(str(tmp_path / "pfs" / "step-1" / "__0_0.distcp")) == 0o644
    assert mode(str(tmp_path / "pfs" / "step-1")) == 0o755


def test_write_atomic_never_widens_a_persistent_file(tmp_path):
    """Without modes (the persistent tier) a rewrite keeps no bit the replaced file lacked."""
    store = Store(str(tmp_path))
    with umask(0o022):
        store.write_atomic("tierckpt-lineage.json", b"1")
        assert mode(store.path("tierckpt-lineage.json")) == 0o644
        os.chmod(store.path("tierckpt-lineage.json"), 0o600)  # the user narrowed it
        store.write_atomic("tierckpt-lineage.json", b"2")
        assert mode(store.path("tierckpt-lineage.json")) == 0o600
        assert store.read_bytes("tierckpt-lineage.json") == b"2"
    with umask(0o077):
        store.write_atomic("new.json", b"x")
    assert mode(store.path("new.json")) == 0o600


def test_start_tightens_directories_an_earlier_run_left_open(tmp_path):
    """An earlier run under the umask (or the "group" setting) left 0755 directories: the
    node leader sets tierckpt's own directories to the setting; a root the operator made is
    left as it is."""
    from tierckpt.startup import tighten_local

    root = tmp_path / "root"
    with umask(0o022):
        for d in ("local/step-4", "replicas/node-1/step-4", "replicas/other"):
            (root / d).mkdir(parents=True)
    tighten_local(Store(str(root), perms.modes_of("private")))
    assert mode(str(root)) == 0o755
    assert [mode(str(root / d)) for d in ("local", "replicas", "replicas/node-1")] == [0o700] * 3
    assert mode(str(root / "replicas" / "other")) == 0o755  # not a tierckpt directory


def test_bad_setting_names_the_option(tmp_path):
    from tierckpt.config import TierConfig

    for bad in ("public", "0700", 700, None):
        with pytest.raises(ConfigError) as e:
            TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"),
                       local_permissions=bad)
        assert e.value.option == "local_permissions", e.value
        assert "'private'" in str(e.value) and "'group'" in str(e.value), str(e.value)
    ok = TierConfig(local_root=str(tmp_path / "n{node}"), persistent_root=str(tmp_path / "p"))
    assert ok.local_permissions == "private"


def test_titan_toml_key(tmp_path):
    pytest.importorskip("torchtitan")
    from titan_plugin.config import build_tier_config
    from titan_plugin.toml import load_config

    toml = tmp_path / "c.toml"
    toml.write_text('[job]\nmodule = "llama3"\nconfig = "llama3_debugmodel"\n'
                    '[checkpoint]\nenable = true\nlocal_permissions = "group"\n')
    assert build_tier_config(load_config(str(toml)).checkpoint, "/p").local_permissions == "group"
    with pytest.raises(ConfigError) as e:
        load_config(str(toml), ["--checkpoint.local_permissions", "world"])
    assert e.value.option == "checkpoint.local_permissions" and "'private'" in str(e.value), str(e.value)


def test_megatron_flag():
    pytest.importorskip("megatron.core")
    from mcore_plugin.args import tier_config_from_args, validate_plugin_args
    from tests.mcore.test_args import GOOD, parse

    args = parse(GOOD + ["--ckpt-plugin-local-permissions", "group"])
    validate_plugin_args(args)
    assert tier_config_from_args(args).local_permissions == "group"
    plain = parse(GOOD)
    validate_plugin_args(plain)
    assert tier_config_from_args(plain).local_permissions == "private"
    with pytest.raises(ConfigError) as e:
        validate_plugin_args(parse(GOOD + ["--ckpt-plugin-local-permissions", "0644"]))
    assert e.value.option == "--ckpt-plugin-local-permissions" and "'group'" in str(e.value), str(e.value)
