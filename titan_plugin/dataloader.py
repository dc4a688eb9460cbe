"""Dataloader positions across a change of the data-parallel degree (torchtitan 0.3).

torchtitan's ``ParallelAwareDataloader`` saves one key per data-parallel rank
(``dataloader.dp_rank_<r>``: that rank's pickled ``StatefulDataLoader`` state) and refuses a
load with another DP degree. With DCP a key is read only by a rank that asks for it, so after
4 → 3 nodes nobody would read old rank 3's position, and after 2 → 3 new rank 2 would ask
for a key that does not exist. This module replaces that state with one object every rank
saves and loads identically, ``dataloader.tierckpt_positions`` (pickled bytes):

    {"format": 1, "dp_degree": D, "num_samples": N or None,
     "ranks": [one entry per old DP rank r = 0..D-1]}
    entry = {"dp_rank": r, "blob": torchtitan's pickled per-rank state (bytes),
             "position": None | {"dataset", "shard_len", "epoch", "sample_idx", "view"},
             "why": why the dataset cannot be repositioned ("" when it can)}

Size: per DP rank, torchtitan's state (which holds the token buffers, each shorter than one
document plus ``seq_len`` tokens) and, after a reshard, the rank's row view as runs. Every rank
gathers all of it at every save (one all-gather over gloo, part of the blocking time): about
``dp_degree`` × (3 buffers × ~5 bytes per token) per rank.

**Same DP degree**: each rank loads its own ``blob`` exactly as torchtitan would (bitwise the
same batches as an uninterrupted run), then re-applies a view left by an earlier reshard.

**Another DP degree** (4 → 3, 2 → 3, or a new ``data_parallel_shard_degree``) needs a
repositionable dataset: torchtitan's ``HuggingFaceTextDataset`` over a map-style
``datasets.Dataset`` (the demo's ``tierckpt_corpus`` is one) with ``num_workers = 0``.
``split_dataset_by_node`` gives old rank r the contiguous rows ``shard(N, D, r)`` (in epoch
e > 0 permuted by ``shuffle(seed=42 + e)``, torchtitan's reloop); r had read the first
``sample_idx`` of them. Let E be the oldest epoch any old rank is in. The rows of epoch E no
old rank had read, in old-rank order, are split into D' contiguous parts (the rule of
``Dataset.shard``); new rank j reads part j, from its start, as its epoch E, then goes on with
epoch E + 1 of its own shard under D' (as a fresh run with D' ranks would). Old rank r's token
buffer (tokens of rows already read, not yet emitted in a sequence) is prepended to new rank
``r mod D'``'s stream, in old-rank order; a buffer that does not start a document continues
no other document (its positions restart at 0, as a sequence start would make them).

Guarantee: every input token of every row of epoch E (a row's ``tokens[:-1]``, labels
aligned) is emitted exactly once over the old ranks before the save and the new ranks after
the load, except the tokens still in a rank's buffer when it reaches the end of epoch E
(fewer than ``seq_len`` per rank; torchtitan drops them with ``infinite = false`` and carries
them into the next epoch otherwise), and the last partial batch when an epoch ends. Batches
differ from an uninterrupted run on D' ranks (the rows go to other ranks), and the sequences
at the seams differ (buffers are joined). Not guaranteed: rows of epoch E + 1 an old rank had
already read (it was ahead) are read again in epoch E + 1.

Anything else (a streaming dataset, interleaved or chat datasets, worker processes) raises a
:class:`~tierckpt.ConfigError` naming ``checkpoint.exclude_from_loading``: add
``"dataloader"`` there to start the data from the beginning instead.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from torch.distributed.checkpoint.stateful import Stateful

from tierckpt import ConfigError
from tierckpt.integration import all_gather

STATE_KEY = "tierckpt_positions"
FORMAT = 1
RELOOP_SEED = 42  # torchtitan's HuggingFaceTextDataset.reloop shuffles epoch e with seed 42 + e
_OPTION = "checkpoint.exclude_from_loading"
_VIEW_ATTR = "_tierckpt_view"  # (epoch, runs) set on the dataset by a reshard


# ----------------------------------------------------------------------------- index runs
def to_runs(indices) -> list[tuple[int, int]]:
    """Compress row indices into ``[(start, stop), …]`` runs of consecutive values (order kept)."""
    a = np.asarray(indices, dtype=np.int64)
    if a.size == 0:
        return []
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], cut))
    stops = np.concatenate((cut, [a.size]))
    return [(int(a[s]), int(a[e - 1]) + 1) for s, e in zip(starts, stops)]


def from_runs(runs) -> np.ndarray:
    """Inverse of :func:`to_runs`: an int64 array of row indices."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``n`` rows split into ``parts`` contiguous parts,
    the first ``n % parts`` one row longer (``datasets.Dataset.shard(contiguous=True)``)."""
    div, mod = divmod(n, parts)
    start = div * index + min(index, mod)
    return start, start + div + (1 if index < mod else 0)


def standard_order(num_samples: int, dp_degree: int, dp_rank: int, epoch: int) -> np.ndarray:
    """Global row indices in the order torchtitan's rank ``dp_rank`` of ``dp_degree`` reads them
    in ``epoch``: its contiguous shard, shuffled with seed ``42 + epoch`` when ``epoch > 0``.
    Computed with ``datasets`` itself (the permutation depends only on the length and seed)."""
    from datasets import Dataset

    rows = Dataset.from_dict({"i": np.arange(num_samples, dtype=np.int64)})
    rows = rows.shard(num_shards=dp_degree, index=dp_rank, contiguous=True)
    if epoch > 0:
        rows = rows.shuffle(seed=RELOOP_SEED + epoch)
    return np.asarray(rows["i"], dtype=np.int64)


# ------------------------------------------------------------------------------- one rank
def _why_not_repositionable(dataloader) -> str:
    """"" when ``dataloader``'s position can be moved to another DP degree, else the reason."""
    from datasets import Dataset
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    ds = getattr(dataloader, "dataset", None)
    if not isinstance(ds, HuggingFaceTextDataset):
        return f"its dataset is a {type(ds).__name__}, not torchtitan's HuggingFaceTextDataset"
    if not isinstance(ds._data, Dataset):
        return f"dataset {ds.dataset_name!r} is not a map-style datasets.Dataset (streaming?)"
    if getattr(dataloader, "num_workers", 0):
        return f"dataloader.num_workers = {dataloader.num_workers} (worker processes hold the positions)"
    return ""


def rank_entry(dataloader) -> dict[str, Any]:
    """This DP rank's entry of the global object (see the module docstring); not collective.

    Args:
        dataloader: a torchtitan ``ParallelAwareDataloader`` (``dp_rank``, ``dp_world_size``).
    """
    sd = dataloader.state_dict()  # torchtitan's own: {"dp_rank_<r>": pickled, "world_size": D}
    entry: dict[str, Any] = {"dp_rank": int(dataloader.dp_rank), "blob": sd[f"dp_rank_{dataloader.dp_rank}"],
                             "position": None, "why": _why_not_repositionable(dataloader)}
    if entry["why"]:
        return entry
    ds = dataloader.dataset  # with num_workers = 0 its fields are the state just taken
    view = getattr(ds, _VIEW_ATTR, None)
    entry["position"] = {
        "dataset": ds.dataset_name, "shard_len": len(ds._original_data), "epoch": int(ds._epoch),
        "sample_idx": int(ds._sample_idx),
        "view": view[1] if view is not None and view[0] == ds._epoch else None}
    return entry


def buffers(entry: dict[str, Any]) -> dict[str, list[int]]:
    """The token buffers of an entry (``inputs``, ``labels``, ``positions``), from the
    ``dataset_state`` of torchtitan's per-rank state (``num_workers = 0``)."""
    st = pickle.loads(entry["blob"])["dataset_state"]
    return {"inputs": list(st["inputs_buffer"]), "labels": list(st["labels_buffer"]),
            "positions": list(st.get("positions_buffer", []))}


def merge_entries(entries: list[dict[str, Any]], dp_degree: int) -> dict[str, Any]:
    """The global object from every rank's :func:`rank_entry` (ranks of one DP rank, e.g. its
    tensor-parallel peers, hold the same position: the first is kept).

    Raises:
        ValueError: a DP rank in ``0..dp_degree-1`` has no entry.
    """
    by_rank: dict[int, dict] = {}
    for e in entries:
        by_rank.setdefault(e["dp_rank"], e)
    missing = sorted(set(range(dp_degree)) - set(by_rank))
    if missing:
        raise ValueError(f"dataloader positions: no entry for DP ranks {missing} of {dp_degree}")
    ranks = [by_rank[r] for r in range(dp_degree)]
    positions = [e["position"] for e in ranks]
    n = sum(p["shard_len"] for p in positions) if all(p is not None for p in positions) else None
    return {"format": FORMAT, "dp_degree": dp_degree, "num_samples": n, "ranks": ranks}


# ----------------------------------------------------------------------------- the reshard
def _join_buffers(parts: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """Concatenate old ranks' buffers; a buffer that starts mid-document after another buffer
    gets positions from 0, so it continues no other document (what a sequence start does)."""
    inputs: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for p in parts:
        pos = list(p["positions"])
        if positions and pos and pos[0] != 0:
            head = next((i for i, v in enumerate(pos) if v == 0), len(pos))
            off = pos[0]
            pos[:head] = [v - off for v in pos[:head]]
        inputs += p["inputs"]
        labels += p["labels"]
        positions += pos
    return inputs, labels, positions


def _old_order(state: dict[str, Any], r: int) -> np.ndarray:
    p = state["ranks"][r]["position"]
    if p["view"] is not None:
        return from_runs(p["view"])
    return standard_order(state["num_samples"], state["dp_degree"], r, p["epoch"])


def plan_reshard(state: dict[str, Any], new_degree: int) -> list[dict[str, Any]]:
    """Where each of ``new_degree`` DP ranks resumes (pure; see the module docstring).

    Args:
        state: the global object (every old rank repositionable).
        new_degree: the new DP degree, >= 1.
    Returns:
        one dict per new DP rank: ``epoch`` (E), ``view`` (runs of global row indices it reads
        in epoch E, from the first), ``inputs``/``labels``/``positions`` (its token buffers).
    Raises:
        ValueError: ``new_degree`` < 1 or an old rank without a position.
    """
    if new_degree < 1:
        raise ValueError(f"new_degree must be >= 1, got {new_degree}")
    positions = [e["position"] for e in state["ranks"]]
    if any(p is None for p in positions):
        raise ValueError("plan_reshard needs every old rank's position")
    epoch = min(p["epoch"] for p in positions)
    rest = [_old_order(state, r)[p["sample_idx"]:] for r, p in enumerate(positions) if p["epoch"] == epoch]
    remaining = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
    out = []
    for j in range(new_degree):
        a, b = shard_bounds(len(remaining), new_degree, j)
        inputs, labels, pos = _join_buffers([buffers(e) for e in state["ranks"][j::new_degree]])
        out.append({"epoch": epoch, "view": to_runs(remaining[a:b]), "inputs": inputs, "labels": labels,
                    "positions": pos})
    return out


# -------------------------------------------------------------------------------- loading
def _full_dataset(ds, dataset_path: str | None, num_samples: int):
    """The unsplit dataset, loaded again through torchtitan's registry (``DATASETS``)."""
    from datasets import Dataset
    from torchtitan.hf_datasets.text_datasets import DATASETS

    cfg = DATASETS[ds.dataset_name]
    full = cfg.loader(dataset_path or cfg.path)
    if not isinstance(full, Dataset) or len(full) != num_samples:
        got = len(full) if isinstance(full, Dataset) else type(full).__name__
        raise ConfigError(_OPTION, f"the checkpoint's dataloader positions are for {num_samples} rows of dataset "
                          f"{ds.dataset_name!r}, it now has {got}; add \"dataloader\" to start the data afresh")
    return full


def _apply_view(dataloader, epoch: int, sample_idx: int, buffers: dict, runs, full) -> None:
    """Set the dataset's position directly (no deferred StatefulDataLoader state)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    StatefulDataLoader.load_state_dict(dataloader, {})  # drops an iterator made before: the next starts here
    ds = dataloader.dataset
    ds.load_state_dict({"inputs_buffer": list(buffers["inputs"]), "labels_buffer": list(buffers["labels"]),
                        "positions_buffer": list(buffers["positions"]), "sample_idx": sample_idx, "epoch": epoch})
    ds._data = full.select(from_runs(runs))  # replaces the epoch's standard order set just above
    setattr(ds, _VIEW_ATTR, (epoch, list(runs)))


def _check_reshardable(state: dict[str, Any], dataloader) -> None:
    why = [f"old DP rank {e['dp_rank']}: {e['why']}" for e in state["ranks"] if e["position"] is None]
    mine = _why_not_repositionable(dataloader)
    if mine:
        why.append(f"this run: {mine}")
    if not why:
        names = {e["position"]["dataset"] for e in state["ranks"]} | {dataloader.dataset.dataset_name}
        if len(names) > 1:
            why.append(f"the dataset changed ({', '.join(sorted(names))})")
    if why:
        raise ConfigError(_OPTION, f"the checkpoint's dataloader state is for data-parallel degree "
                          f"{state['dp_degree']}, this run has {dataloader.dp_world_size}, and the position "
                          f"cannot be moved: {'; '.join(why)}. Add \"dataloader\" to "
                          f"{_OPTION} to start the data from the beginning")


def load_positions(dataloader, state: dict[str, Any], dataset_path: str | None = None) -> str:
    """Position ``dataloader`` (this process's DP rank) from the global object; not collective.

    Args:
        dataloader: a torchtitan ``ParallelAwareDataloader``.
        state: the global object (:func:`merge_entries`, decoded).
        dataset_path: the run's ``dataloader.dataset_path`` (None: the registry's default),
            needed only to re-read the unsplit dataset for a view.
    Returns:
        "same-degree" or "resharded D->D'".
    Raises:
        ConfigError: naming ``checkpoint.exclude_from_loading``: the DP degree changed and the
            position cannot be moved, the dataset changed, or the object is not this format.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(_OPTION, "the checkpoint's dataloader state is not a tierckpt positions object "
                          f"(format {FORMAT}); add \"dataloader\" to start the data afresh")
    old, new = state["dp_degree"], dataloader.dp_world_size
    if old == new:
        e = state["ranks"][dataloader.dp_rank]
        p = e["position"]
        if p is None or p["view"] is None:
            if hasattr(dataloader.dataset, _VIEW_ATTR):
                delattr(dataloader.dataset, _VIEW_ATTR)
            dataloader.load_state_dict({f"dp_rank_{dataloader.dp_rank}": e["blob"], "world_size": new})
        else:  # a view left by an earlier reshard: torchtitan's deferred load would replace it
            full = _full_dataset(dataloader.dataset, dataset_path, state["num_samples"])
            _apply_view(dataloader, p["epoch"], p["sample_idx"], buffers(e), p["view"], full)
        return "same-degree"
    _check_reshardable(state, dataloader)
    ds = dataloader.dataset
    n = state["num_samples"]
    a, b = shard_bounds(n, new, dataloader.dp_rank)
    if len(ds._original_data) != b - a:
        raise ConfigError(_OPTION, f"dataset {ds.dataset_name!r} has another row count than the checkpoint's "
                          f"({n}); add \"dataloader\" to start the data afresh")
    plan = plan_reshard(state, new)[dataloader.dp_rank]
    _apply_view(dataloader, plan["epoch"], 0, plan, plan["view"], _full_dataset(ds, dataset_path, n))
    return f"resharded {old}->{new}"


def encode(state: dict[str, Any]) -> bytes:
    """The bytes saved under ``dataloader.tierckpt_positions``."""
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> Any:
    """Inverse of :func:`encode` (the checkpoint is trusted as torchtitan trusts its pickles)."""
    return pickle.loads(payload)


# ------------------------------------------------------------------------- the Stateful
class DataloaderPositions(Stateful):
    """The dataloader's entry in the checkpointer's states (replaces torchtitan's per-rank one).

    Saving: :meth:`prepare` (collective over ``group``: every rank, same step) gathers every
    rank's position; the next :meth:`state_dict` returns it, identical on every rank.
    Loading: :meth:`load_state_dict` only keeps the bytes (a restore may try several sources
    and must not fail on a policy error); :meth:`apply` then positions the dataloader.

    Args:
        dataloader: torchtitan ``ParallelAwareDataloader``.
        group: a process group of every rank (gloo), used only by :meth:`prepare`.
        dataset_path: the run's ``dataloader.dataset_path`` (None: the registry's default).
    """

    def __init__(self, dataloader, group, dataset_path: str | None = None):
        self.dataloader, self.group, self.dataset_path = dataloader, group, dataset_path
        self._payload: bytes | None = None
        self.loaded: bytes | None = None
        self.outcome = ""

    def prepare(self) -> None:
        """Gather every rank's position for the next save (collective over ``group``)."""
        entries = all_gather(rank_entry(self.dataloader), self.group)
        self._payload = encode(merge_entries(entries, self.dataloader.dp_world_size))

    def state_dict(self) -> dict[str, Any]:
        """``{"tierckpt_positions": bytes}``: the prepared object (a placeholder before the
        first :meth:`prepare`, which a load replaces)."""
        return {STATE_KEY: self._payload if self._payload is not None else b""}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the loaded bytes for :meth:`apply`."""
        self.loaded = state_dict.get(STATE_KEY)

    def apply(self) -> str:
        """Position the dataloader from the loaded bytes (:func:`load_positions`); returns the
        outcome. Raises ConfigError naming ``checkpoint.exclude_from_loading`` (see there)."""
        if not self.loaded:
            raise ConfigError(_OPTION, "the checkpoint holds no dataloader positions; add \"dataloader\" to "
                              "start the data afresh")
        self.outcome = load_positions(self.dataloader, decode(self.loaded), self.dataset_path)
        self.loaded = None
        return self.outcome
