"""Rank functions of the persistent tier on a real S3-API server (tests/test_s3_persistent.py,
run through tests.harness.run_world). Each takes the run's ``s3://`` URL, the local base
directory and the server's endpoint; credentials come from the environment (AWS_*) unless the
config passes ``storage_options``."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from tests.scenarios import app_state, apply_state, assert_bitwise, build, snapshot, train_step
from tierckpt.config import TierConfig
from tierckpt.engine import TieredCheckpointer


def s3_config(url: str, base: str, **kw) -> TierConfig:
    """Both tiers, the persistent one at ``url``; saves wait for the previous one (every save
    here is expected to happen)."""
    kw.setdefault("local_root", os.path.join(base, "nvme", "node-{node}"))
    kw.setdefault("busy_tier_policy", "wait")
    return TierConfig(persistent_root=url, job_id="s3", replication_factor=2, **kw)


def phase_save(rank, world, url, base, steps, cfg_kw):
    """Train and save every tier at each of ``steps``; keep the last step's snapshot in
    ``base/ref``. Returns each save's records ``{tier: (ok, error)}`` and the lineage."""
    eng = TieredCheckpointer(s3_config(url, base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    out = {}
    for s in steps:
        train_step(model, opt, s, rank)
        recs = eng.save(s, app_state(model, opt)).wait(timeout=120)
        out[s] = {t: (r.ok, r.error) for t, r in recs.items()}
    eng.close()
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save(snapshot(model, opt), os.path.join(base, "ref", f"rank{rank}.pt"))
    return {"records": out, "lineage": eng.lineage, "committed": eng.persistent.committed_steps()}


def phase_restore(rank, world, url, base, wipe_local, cfg_kw):
    """Restore into a fresh model (node-local roots removed first when ``wipe_local``); the
    state must equal the saved snapshot bitwise when the restored step is the last saved one.
    Returns the step, the sources' kinds and the failures."""
    if wipe_local and rank == 0:
        shutil.rmtree(os.path.join(base, "nvme"), ignore_errors=True)
    dist.barrier()
    eng = TieredCheckpointer(s3_config(url, base, **cfg_kw), node_id=rank)
    model, opt = build(seed=7)
    train_step(model, opt, 99, rank)
    sd = app_state(model, opt)
    res = eng.restore(sd)
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    equal = True
    try:
        assert_bitwise(snapshot(model, opt), torch.load(os.path.join(base, "ref", f"rank{rank}.pt"),
                                                        weights_only=False))
    except AssertionError:
        equal = False
    eng.close()
    return {"step": res.step, "kinds": sorted({o.source.kind for o in res.sources.values()}), "equal": equal,
            "failures": [(f.source.kind, f.step, f.error) for f in res.failures],
            "persistent_bytes": res.persistent_bytes_read}


def phase_write_refused(rank, world, url, base, bucket, endpoint, fault):
    """Step 1 saves; then the bucket refuses writes: ``fault="deny"``, a bucket policy denies
    ``PutObject``; ``fault="full"``, the bucket takes only half of step 1's bytes more (a full
    drive, tests/s3_server.py), so step 2's save fails part-way. Step 2's persistent save fails
    (the local tier still commits it), the next persistent save raises TierFailedError naming
    the URL; once writes are allowed again the job goes on and commits step 3. Returns each
    save's records, the error raised, the committed steps, and (rank 0) step 1's objects'
    ETags before the fault and at the end."""
    from tests.s3_server import S3Server
    from tierckpt.errors import TierFailedError

    server = S3Server()
    server.port = int(endpoint.rsplit(":", 1)[1])
    eng = TieredCheckpointer(s3_config(url, base), node_id=rank)
    model, opt = build(seed=0)
    out = {}
    train_step(model, opt, 1, rank)
    out["s1"] = {t: r.ok for t, r in eng.save(1, app_state(model, opt)).wait(timeout=120).items()}
    dist.barrier()
    if rank == 0:
        out["etags_before"] = server.keys(bucket, "run/step-1/", field="ETag")
        if fault == "deny":
            server.deny(bucket, ["s3:PutObject"])
        else:
            server.budget(bucket, sum(server.keys(bucket, "run/step-1/").values()) // 2)
    dist.barrier()
    train_step(model, opt, 2, rank)
    recs = eng.save(2, app_state(model, opt)).wait(timeout=120)
    out["s2"] = {t: (r.ok, r.error) for t, r in recs.items()}
    train_step(model, opt, 3, rank)
    try:
        eng.save(3, app_state(model, opt))
        out["raised"] = None
    except TierFailedError as e:
        out["raised"] = (e.tier, e.step, str(e))
    dist.barrier()
    if rank == 0:
        if fault == "deny":
            server.allow_all(bucket)
        else:
            server.budget(bucket, None)
    dist.barrier()
    out["s3"] = {t: r.ok for t, r in eng.save(3, app_state(model, opt)).wait(timeout=120).items()}
    eng.close()
    out["committed"] = eng.persistent.committed_steps()
    if rank == 0:
        out["etags_after"] = server.keys(bucket, "run/step-1/", field="ETag")
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save(snapshot(model, opt), os.path.join(base, "ref", f"rank{rank}.pt"))
    return out


def phase_start(rank, world, url, base):
    """The engine's start on ``url`` (persistent tier only): the ConfigError's option and text,
    or None when it started."""
    from tierckpt.errors import ConfigError

    try:
        TieredCheckpointer(s3_config(url, base, tiers=("persistent",), local_root=None), node_id=rank)
    except ConfigError as e:
        return (e.option, str(e))
    return None
