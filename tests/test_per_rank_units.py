"""Per-rank values under one key, without processes (tierckpt/io/per_rank.py, the planners).

Each "rank" is planned in this process with ``per_rank.global_rank`` patched; the coordinator's
global plan, the save record, the load-side choice of entry and the in-cluster merge are checked
on real DCP plans and metadata (node-local checkpoints written with ``no_dist``).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import WriteItemType

from tierckpt.io import per_rank
from tierckpt.io.planner import NodeLocalSavePlanner, PerRankSavePlanner, PlanCoverageError, VerifyingLoadPlanner
from tierckpt.restore.chunkmap import merge_metadata


def _state(rank: int) -> dict:
    return {"probe": torch.full((4,), 100.0 + rank), "shared": torch.arange(3.0), "obj": {"r": rank, "same": 1}}


def _global_plan(monkeypatch, states: dict[int, dict], world: int):
    """Plan every rank of ``states`` here; returns (final plans by rank, metadata)."""
    monkeypatch.setattr(per_rank, "global_world", lambda: world)
    planners, plans = {}, []
    for r, sd in states.items():
        monkeypatch.setattr(per_rank, "global_rank", lambda r=r: r)
        p = PerRankSavePlanner()
        p.set_up_planner(sd, is_coordinator=r == min(states))
        plans.append(p.create_local_plan())
        planners[r] = p
    final, md = planners[min(states)].create_global_plan(plans)
    return dict(zip(states, final)), md, planners


def test_only_differing_values_get_qualified_keys_and_the_plain_copy_is_the_lowest_rank(monkeypatch):
    final, md, planners = _global_plan(monkeypatch, {0: _state(0), 1: _state(1)}, 2)
    keys = set(md.state_dict_metadata)
    assert keys == {"probe", "shared", "obj.r", "obj.same"} | {per_rank.qualified(r, k) for r in (0, 1)
                                                                for k in ("probe", "obj.r")}
    plain_probe = [r for r, p in final.items() if any(it.index.fqn == "probe" for it in p.items)]
    assert plain_probe == [0]
    rec = md.planner_data[per_rank.RECORD_KEY]
    assert rec["world"] == 2 and rec["ranks"] == [0, 1]
    plain, diff = rec["items"]["probe"]
    assert plain == per_rank.tensor_digest(_state(0)["probe"]) and list(diff) == [1]
    assert rec["items"]["shared"][1] == {}
    # the qualified write of rank 1 resolves to rank 1's own tensor / object bytes
    q = next(it for it in final[1].items if it.index.fqn == per_rank.qualified(1, "probe"))
    assert torch.equal(planners[1].resolve_data(q), _state(1)["probe"])
    qo = next(it for it in final[1].items if it.index.fqn == per_rank.qualified(1, "obj.r"))
    assert qo.type == WriteItemType.BYTE_IO and torch.load(planners[1].resolve_data(qo)) == 1


def test_identical_values_cost_nothing(monkeypatch):
    _, md, _ = _global_plan(monkeypatch, {0: _state(0), 1: _state(0)}, 2)
    assert not [k for k in md.state_dict_metadata if k.startswith(per_rank.PREFIX)]


def _load_plan(md, sd, rank, monkeypatch, planner_cls=VerifyingLoadPlanner):
    monkeypatch.setattr(per_rank, "global_rank", lambda: rank)
    p = planner_cls()
    p.set_up_planner(sd, md, is_coordinator=True)
    return p.create_local_plan()


def test_each_rank_reads_its_own_entry_a_new_rank_the_plain_one_with_a_warning(monkeypatch, caplog):
    _, md, _ = _global_plan(monkeypatch, {0: _state(0), 1: _state(1)}, 2)
    for r in (0, 1):
        plan = _load_plan(md, {"probe": torch.zeros(4), "shared": torch.zeros(3)}, r, monkeypatch)
        src = {it.dest_index.fqn: it.storage_index.fqn for it in plan.items}
        assert src == {"probe": per_rank.qualified(r, "probe"), "shared": "shared"}
    with caplog.at_level(logging.WARNING, logger="tierckpt.io.per_rank"):
        plan = _load_plan(md, {"probe": torch.zeros(4), "shared": torch.zeros(3)}, 2, monkeypatch)
    assert {it.storage_index.fqn for it in plan.items} == {"probe", "shared"}
    assert "['probe']" in caplog.text and "did not exist" in caplog.text


def test_a_saved_ranks_value_missing_is_refused(monkeypatch):
    _, md, _ = _global_plan(monkeypatch, {0: _state(0), 1: _state(1)}, 2)
    del md.state_dict_metadata[per_rank.qualified(1, "probe")]
    with pytest.raises(PlanCoverageError, match="own values"):
        _load_plan(md, {"probe": torch.zeros(4)}, 1, monkeypatch)
    rec = md.planner_data[per_rank.RECORD_KEY]
    rec["ranks"] = [0]  # rank 1 < world 2 but no copy of its node: refused as well
    with pytest.raises(PlanCoverageError, match="own values"):
        _load_plan(md, {"shared": torch.zeros(3), "probe": torch.zeros(4)}, 1, monkeypatch)


def _node_save(path, monkeypatch, rank, world, sd):
    monkeypatch.setattr(per_rank, "global_rank", lambda: rank)
    monkeypatch.setattr(per_rank, "global_world", lambda: world)
    dcp.save(sd, checkpoint_id=path, planner=NodeLocalSavePlanner(), no_dist=True)
    return FileSystemReader(path).read_metadata()


def test_in_cluster_merge_finds_each_ranks_value_in_single_rank_node_copies(monkeypatch, tmp_path):
    """Node copies of one rank each hold no qualified key; the merged view names, per saved
    rank, the copy whose plain value is that rank's."""
    parts = {n: _node_save(str(tmp_path / f"n{n}"), monkeypatch, n, 2, _state(n)) for n in (0, 1)}
    assert not [k for md in parts.values() for k in md.state_dict_metadata if k.startswith(per_rank.PREFIX)]
    merged, origins = merge_metadata(parts)
    for r in (0, 1):
        q = per_rank.qualified(r, "probe")
        assert q in merged.state_dict_metadata
        assert {m for idx, alts in origins.items() if idx.fqn == q for m, _ in alts} == {r}
    assert {m for idx, alts in origins.items() if idx.fqn == "probe" for m, _ in alts} == {0}
    assert {m for idx, alts in origins.items() if idx.fqn == "shared" for m, _ in alts} == {0, 1}
    assert per_rank.qualified(0, "shared") not in merged.state_dict_metadata
    plan = _load_plan(merged, {"probe": torch.zeros(4), "obj": {"r": -1, "same": -1}}, 1, monkeypatch)
    assert {it.storage_index.fqn for it in plan.items} == {per_rank.qualified(1, "probe"),
                                                          per_rank.qualified(1, "obj.r"), "obj.same"}
    # node 1's copy lost: rank 1's values are nowhere, its load is refused
    merged1, _ = merge_metadata({0: parts[0]})
    with pytest.raises(PlanCoverageError):
        _load_plan(merged1, {"probe": torch.zeros(4)}, 1, monkeypatch)


def test_a_stock_checkpoint_without_record_loads_as_before(monkeypatch, tmp_path):
    path = str(tmp_path / "stock")
    dcp.save(_state(0), checkpoint_id=path, no_dist=True)
    md = FileSystemReader(path).read_metadata()
    assert per_rank.record_of(md) is None
    plan = _load_plan(md, {"probe": torch.zeros(4)}, 5, monkeypatch)
    assert [it.storage_index.fqn for it in plan.items] == ["probe"]
    assert os.path.exists(os.path.join(path, ".metadata"))


def test_object_digest_does_not_depend_on_the_threads_crc_setting():
    """torch keeps the zip-CRC option per thread; a tier thread with it on and another with it
    off must still hash one object alike (else every object looks per-rank)."""
    import threading

    from torch.serialization import get_crc32_options, set_crc32_options

    out = {}

    def run(crc):
        set_crc32_options(crc)
        out[crc] = per_rank.object_bytes({"step": 5})
        out[f"after-{crc}"] = get_crc32_options()

    for crc in (True, False):
        t = threading.Thread(target=run, args=(crc,))
        t.start()
        t.join()
    assert out[True] == out[False] and out["after-True"] is True and out["after-False"] is False
