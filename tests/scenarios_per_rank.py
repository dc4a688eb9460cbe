"""Rank functions of the per-rank value tests (tests/test_per_rank_values.py).

Every rank saves, under the same keys, values of its own: ``probe`` (a plain tensor),
``rng`` (its CPU RNG state after ``manual_seed(1000 + rank)``), ``counter`` (an int) and
``obj`` (a dict of objects); ``shared`` and ``note`` are the same on every rank (replicated).
"""

from __future__ import annotations

import torch

from tests.scenarios import assert_bitwise, make_config
from tierckpt.engine import TieredCheckpointer


def expected(rank: int) -> dict:
    """Rank ``rank``'s saved state (the reference a restore must give back bitwise)."""
    torch.manual_seed(1000 + rank)
    return {
        "probe": torch.full((4,), 100.0 + rank),
        "rng": torch.get_rng_state(),
        "counter": 7 + 10 * rank,
        "obj": {"rank": rank, "tag": f"rank-{rank}"},
        "shared": torch.arange(8, dtype=torch.float32),
        "note": "same everywhere",
    }


def template() -> dict:
    """A state of the same structure whose every value differs from any saved one."""
    return {
        "probe": torch.zeros(4),
        "rng": torch.zeros_like(torch.get_rng_state()),
        "counter": -1,
        "obj": {"rank": -1, "tag": ""},
        "shared": torch.zeros(8),
        "note": "",
    }


def phase_save(rank, world, base, rpn, k):
    """Save rank 0's values on every rank at step ``k - 1`` (nothing differs), then
    ``expected(rank)`` at step ``k``, to every tier (``rpn`` ranks per node)."""
    eng = TieredCheckpointer(make_config(base), node_id=rank // rpn)
    eng.save(k - 1, expected(0))
    eng.save(k, expected(rank))
    eng.wait()
    eng.close()
    return True


def phase_restore(rank, world, base, rpn, saved_world):
    """Restore into :func:`template`; a rank that existed at save time must get its own values
    bitwise (and its RNG must draw what the saved one drew); a new rank gets rank 0's.
    Returns ``{"step", "sources", "probe", "save_id", "attempts"}``."""
    eng = TieredCheckpointer(make_config(base), node_id=rank // rpn)
    sd = template()
    res = eng.restore(sd)
    assert res is not None, "nothing restored"
    if rank < saved_world:
        assert_bitwise(sd, expected(rank), f"rank {rank}")
        torch.set_rng_state(sd["rng"])
        got = torch.rand(3)
        torch.manual_seed(1000 + rank)
        assert torch.equal(got, torch.rand(3)), f"rank {rank}: restored RNG draws another stream"
    else:
        assert_bitwise(sd, expected(0), f"new rank {rank}")
    eng.close()
    return {"step": res.step, "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
            "probe": float(sd["probe"][0]), "save_id": res.save_id, "attempts": res.attempts}

