"""titan_plugin/dataloader.py: the dataloader's position across a change of the data-parallel
degree, at the dataloader level (torchtitan 0.3's HuggingFaceTextDataLoader, no training).

The documents are "i n" strings and the tokenizer maps document i to the tokens
``B_i, B_i + 1, …, B_i + n + 1`` with ``B_i = 10000 (i + 1)``: every input token names its
document and offset, a label is always its input + 1, and positions restart at a document
change. "Exactly once" below means: the input tokens emitted by the old ranks before the save,
by the new ranks after the load until the end of the epoch, and those left in the new ranks'
buffers at the end of the epoch (fewer than seq_len each; torchtitan never emits them with
``infinite = false``) are every document's ``tokens[:-1]``, each token once.
"""

from __future__ import annotations

import json
import pickle
from collections import Counter

import numpy as np
import pytest

from tierckpt import ConfigError
from titan_plugin import dataloader as pos

NAME, STREAM = "tierckpt_test_docs", "tierckpt_test_stream"
N_DOCS = 41  # not a multiple of 2, 3 or 4: uneven shards
SEQ, BATCH = 8, 2


def doc_len(i: int) -> int:
    return 3 + (i * 7) % 11  # body tokens: 5..15 tokens per document with BOS/EOS


def texts(n: int = N_DOCS) -> list[str]:
    return [f"{i} {doc_len(i)}" for i in range(n)]


class DocTokenizer:
    """Document i ("i n") -> [B_i, B_i + 1, …, B_i + n + 1], B_i = 10000 (i + 1)."""

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        i, n = map(int, text.split())
        return [10000 * (i + 1) + k for k in range(n + 2)]


def all_input_tokens(n: int = N_DOCS) -> Counter:
    return Counter(t for i in range(n) for t in DocTokenizer().encode(f"{i} {doc_len(i)}")[:-1])


@pytest.fixture
def registry(monkeypatch):
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    monkeypatch.setitem(DATASETS, NAME, DatasetConfig(
        path="-", loader=lambda path: Dataset.from_dict({"text": texts()}), sample_processor=lambda s: s["text"]))
    monkeypatch.setitem(DATASETS, STREAM, DatasetConfig(
        path="-", loader=lambda path: Dataset.from_dict({"text": texts()}).to_iterable_dataset(num_shards=4),
        sample_processor=lambda s: s["text"]))
    return DATASETS


def build(dp: int, rank: int, dataset: str = NAME, path: str | None = None, infinite: bool = False):
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    cfg = HuggingFaceTextDataLoader.Config(dataset=dataset, dataset_path=path, infinite=infinite)
    return HuggingFaceTextDataLoader(cfg, dp_world_size=dp, dp_rank=rank, tokenizer=DocTokenizer(), seq_len=SEQ,
                                     local_batch_size=BATCH)


class Stream:
    """One dataloader's emitted sequences; its iterator is kept so consumption can resume."""

    def __init__(self, dl):
        self.dl, self.it, self.rows = dl, iter(dl), []

    def take(self, batches: int | None) -> "Stream":
        for b, (inp, labels) in enumerate(self.it):
            for x, p, y in zip(inp["input"], inp["positions"], labels):
                self.rows.append((x.tolist(), p.tolist(), y.tolist()))
            if batches is not None and b + 1 == batches:
                break
        return self


def save(dls) -> dict:
    """The global object as DataloaderPositions.prepare builds it, through its bytes."""
    return pos.decode(pos.encode(pos.merge_entries([pos.rank_entry(d) for d in dls], len(dls))))


def check_rows(rows) -> None:
    """Labels are inputs + 1; positions start at 0 and restart exactly where the document changes."""
    for x, p, y in rows:
        assert y == [t + 1 for t in x]
        assert p[0] == 0
        for k in range(1, len(x)):
            same_doc = x[k] // 10000 == x[k - 1] // 10000 and x[k] == x[k - 1] + 1
            assert p[k] == (p[k - 1] + 1 if same_doc else 0), (x, p)


def assert_exactly_once(phases: list[list[Stream]], n: int = N_DOCS) -> None:
    rows = [r for streams in phases for s in streams for r in s.rows]
    check_rows(rows)
    seen = Counter(t for x, _, _ in rows for t in x)
    left = [s.dl.dataset._inputs_buffer for s in phases[-1]]
    assert all(len(b) < SEQ for b in left), [len(b) for b in left]
    seen.update(t for b in left for t in b)
    expected = all_input_tokens(n)
    assert seen == expected, {"repeated": sorted(t for t, c in seen.items() if c > 1)[:10],
                              "skipped": sorted(set(expected) - set(seen))[:10]}


def resume(state: dict, new_dp: int, dataset: str = NAME, path: str | None = None) -> list:
    new = [build(new_dp, r, dataset, path) for r in range(new_dp)]
    outcomes = {pos.load_positions(d, state, dataset_path=path) for d in new}
    assert outcomes == ({"same-degree"} if new_dp == state["dp_degree"] else {f"resharded {state['dp_degree']}->{new_dp}"})
    return new


@pytest.mark.parametrize("new_dp", [3, 2, 1, 4])
def test_dp4_to_fewer_ranks_every_token_once(registry, new_dp):
    """4 DP ranks read 2 batches each; 3, 2, 1 (and 4 again) ranks finish the epoch."""
    before = [Stream(build(4, r)).take(2) for r in range(4)]
    state = save([s.dl for s in before])
    assert state["dp_degree"] == 4 and state["num_samples"] == N_DOCS
    assert [e["position"]["shard_len"] for e in state["ranks"]] == [11, 10, 10, 10]
    assert any(pos.buffers(e)["inputs"] for e in state["ranks"]), "the test needs tokens in flight"
    after = [Stream(d).take(None) for d in resume(state, new_dp)]
    assert_exactly_once([before, after])
    if new_dp == 4:  # same degree: bitwise the batches of an uninterrupted run
        whole = [Stream(build(4, r)).take(None) for r in range(4)]
        assert [b.rows + a.rows for b, a in zip(before, after)] == [w.rows for w in whole]


def test_dp2_to_3_and_chained_reshards(registry):
    """2 → 3 (more ranks than buffers), then 3 → 2 from the view the first reshard left, and a
    same-degree restart of that view that repeats the uninterrupted continuation bitwise."""
    first = [Stream(build(2, r)).take(3) for r in range(2)]
    mid = [Stream(d).take(1) for d in resume(save([s.dl for s in first]), 3)]
    state = save([s.dl for s in mid])
    assert all(e["position"]["view"] for e in state["ranks"]), "a reshard's view must be saved"
    # 3 → 2 from that state
    last = [Stream(d).take(None) for d in resume(state, 2)]
    assert_exactly_once([first, mid, last])
    # same degree from a view: the restarted ranks emit what the running ones go on to emit
    again = [Stream(d).take(None) for d in resume(state, 3)]
    done = [len(s.rows) for s in mid]
    assert [a.rows for a in again] == [s.take(None).rows[k:] for s, k in zip(mid, done)]
    assert all(a.rows for a in again)


def test_demo_corpus_is_repositionable(registry, tmp_path, monkeypatch):
    """The demo's dataset (tierckpt_corpus: corpus.jsonl as an in-memory datasets.Dataset)."""
    from tierckpt_dev.titan.assets import DATASET_NAME, register_dataset

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"source": "t", "text": t}) + "\n" for t in texts()))
    monkeypatch.setitem(registry, DATASET_NAME, None)  # restored after the test
    register_dataset(corpus)
    before = [Stream(build(4, r, DATASET_NAME, str(corpus))).take(2) for r in range(4)]
    state = save([s.dl for s in before])
    assert all(e["why"] == "" for e in state["ranks"])
    after = [Stream(d).take(None) for d in resume(state, 3, DATASET_NAME, str(corpus))]
    assert_exactly_once([before, after])


def test_later_epoch_plan_matches_torchtitan_reloop(registry):
    """standard_order is the order torchtitan reads after a reloop (epoch 1: seed 43), and a
    plan in epoch 1 covers the rows no old rank had read exactly once."""
    ds = build(4, 1, infinite=True).dataset
    ds.reloop()
    assert [int(t.split()[0]) for t in ds._data["text"]] == pos.standard_order(N_DOCS, 4, 1, 1).tolist()
    assert pos.standard_order(N_DOCS, 4, 1, 0).tolist() == list(range(11, 21))
    consumed = [3, 0, 10, 7]
    state = {"format": pos.FORMAT, "dp_degree": 4, "num_samples": N_DOCS, "ranks": [
        {"dp_rank": r, "blob": b"", "why": "", "position": {
            "dataset": NAME, "shard_len": 11 if r == 0 else 10, "epoch": 1, "sample_idx": s, "view": None}}
        for r, s in enumerate(consumed)]}
    empty = pickle.dumps({"dataset_state": {"inputs_buffer": [], "labels_buffer": [], "positions_buffer": []}})
    for e in state["ranks"]:
        e["blob"] = empty
    plan = pos.plan_reshard(state, 3)
    read = [i for r, s in enumerate(consumed) for i in pos.standard_order(N_DOCS, 4, r, 1)[:s].tolist()]
    new = [i for p in plan for i in pos.from_runs(p["view"]).tolist()]
    assert sorted(read + new) == list(range(N_DOCS)) and {p["epoch"] for p in plan} == {1}
    assert [len(pos.from_runs(p["view"])) for p in plan] == [7, 7, 7]  # 21 rows left, split evenly
    # an old rank already in epoch 2 finished its epoch-1 rows: nothing of it is left to read
    state["ranks"][2]["position"].update(epoch=2, sample_idx=1)
    left = sorted(i for p in pos.plan_reshard(state, 2) for i in pos.from_runs(p["view"]).tolist())
    assert left == sorted(i for r, s in enumerate(consumed) if r != 2
                          for i in pos.standard_order(N_DOCS, 4, r, 1)[s:].tolist())


def test_buffers_join_without_continuing_a_document():
    a = {"inputs": [1, 2], "labels": [2, 3], "positions": [4, 5]}
    b = {"inputs": [7, 8, 9], "labels": [8, 9, 10], "positions": [6, 7, 0]}
    assert pos._join_buffers([a, b]) == ([1, 2, 7, 8, 9], [2, 3, 8, 9, 10], [4, 5, 0, 1, 0])
    assert pos.to_runs([5, 6, 7, 2, 3, 9]) == [(5, 8), (2, 4), (9, 10)]
    assert pos.from_runs([(5, 8), (2, 4)]).tolist() == [5, 6, 7, 2, 3]
    assert pos.shard_bounds(41, 4, 0) == (0, 11) and pos.shard_bounds(41, 4, 3) == (31, 41)


def test_streaming_dataset_cannot_move_clear_error(registry):
    """A streaming dataset keeps torchtitan's same-degree resume; another degree raises naming
    checkpoint.exclude_from_loading."""
    before = [Stream(build(2, r, STREAM)).take(1) for r in range(2)]
    state = save([s.dl for s in before])
    assert state["num_samples"] is None and "not a map-style" in state["ranks"][0]["why"]
    with pytest.raises(ConfigError) as e:
        resume(state, 1, STREAM)
    msg = str(e.value)
    assert e.value.option == "checkpoint.exclude_from_loading"
    assert "data-parallel degree 2, this run has 1" in msg and "not a map-style" in msg and "Add \"dataloader\"" in msg
    same = [Stream(d).take(1) for d in resume(state, 2, STREAM)]
    whole = [Stream(build(2, r, STREAM)).take(2) for r in range(2)]
    assert [s.rows for s in same] == [w.rows[len(b.rows):] for w, b in zip(whole, before)]


def test_stateful_wrapper_round_trip(registry, monkeypatch):
    """DataloaderPositions: prepare() gathers (here: the 4 ranks of one process), state_dict()
    is the same bytes on every rank, load_state_dict() only keeps them, apply() positions."""
    old = [build(4, r) for r in range(4)]
    streams = [Stream(d).take(1) for d in old]
    monkeypatch.setattr(pos, "all_gather", lambda obj, group: [pos.rank_entry(d) for d in old])
    wrappers = [pos.DataloaderPositions(d, group=None) for d in old]
    assert wrappers[0].state_dict() == {pos.STATE_KEY: b""}  # the load template before any save
    for w in wrappers:
        w.prepare()
    payloads = {w.state_dict()[pos.STATE_KEY] for w in wrappers}
    assert len(payloads) == 1
    new = pos.DataloaderPositions(build(2, 1), group=None)
    with pytest.raises(ConfigError, match="holds no dataloader positions"):
        new.apply()
    new.load_state_dict({pos.STATE_KEY: payloads.pop()})
    assert new.apply() == "resharded 4->2" and new.loaded is None
    ds = new.dataloader.dataset
    first = pos.plan_reshard(save(old), 2)[1]
    assert pos.to_runs(np.asarray([int(t.split()[0]) for t in ds._data["text"]])) == first["view"]
    assert ds._inputs_buffer == first["inputs"] and ds._sample_idx == 0 and len(streams[1].rows) == BATCH
