"""What LitData (0.2.76) does with a ``StreamingDataLoader`` state when it resumes it at
another topology, computed without reading a sample: :func:`resume_plan` runs LitData's own
elastic plan (``StreamingDataset._setup_elastic_resume``: the epoch's canonical stream, the
samples done dropped, the rest dealt over the new ranks and workers) for every rank and worker
and counts what each yields; :func:`prepare_state` corrects two things in a state before
LitData loads it. Checked against LitData's own iteration in ``tests/lightning/
test_litdata.py``.

LitData internals relied on (:func:`missing` names what moved): the state keys of
``StreamingDataset.state_dict``, ``StreamingDataset.shuffler`` and its
``get_chunks_and_intervals_per_workers``, ``litdata.utilities.env._DistributedEnv``,
``litdata.streaming.dataset._replay_sampling``, ``litdata.streaming.shuffle.WindowShuffle``
and the pure functions of ``litdata.streaming.elastic``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

from lightning_elastic.core._compat import unmet

__all__ = [
    "REQUIREMENTS",
    "ResumePlan",
    "elastic",
    "litdata_state",
    "missing",
    "prepare_state",
    "resume_plan",
    "state_problem",
]

REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("litdata", "StreamingDataLoader.load_state_dict"),
    ("litdata", "StreamingDataset.state_dict"),
    ("litdata.utilities.env", "_DistributedEnv.detect"),
    ("litdata.streaming.dataset", "_replay_sampling"),
    ("litdata.streaming.shuffle", "WindowShuffle"),
    ("litdata.streaming.elastic", "restripe_items"),
    ("litdata.streaming.elastic", "lockstep_stream_from_worker_seqs"),
    ("litdata.streaming.elastic", "sample_in_epoch_from_state"),
    ("litdata.streaming.elastic", "topology_changed"),
)


def missing() -> list[str]:
    """The LitData internals this module relies on that the installed LitData lacks (all of
    them when LitData is not installed)."""
    return unmet(REQUIREMENTS)


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What LitData's elastic resume yields of the interrupted epoch at the new topology.

    ``batches[r]``: the batches rank ``r``'s loader yields (over all its workers). The samples
    LitData cannot give once: ``repeated`` were trained before the save and are dealt again (it
    rounds the samples done down to a multiple of ranks x batch size), ``skipped`` are the rest
    of a chunk that was being read (it resumes whole chunks only with its window shuffle, on
    parallel file systems), ``dropped`` are cut by ``drop_last`` to even the ranks (as in any
    epoch with ``drop_last``); and ``uneven`` batches, those of ranks that got more than the
    others, are left out, so that every rank runs the same number of batches.
    """

    batches: tuple[int, ...]
    repeated: int = 0
    skipped: int = 0
    dropped: int = 0
    uneven: int = 0

    @property
    def common(self) -> int:
        """The batches every rank runs (the fewest of any rank)."""
        return min(self.batches, default=0)


def litdata_state(loader: Any, states: list[Any] | None) -> dict[str, Any] | None:
    """The state in ``states`` (Lightning's pending training-loader states) that belongs to
    the StreamingDataLoader ``loader``: the one over the same input directory or, for a
    ``CombinedStreamingDataset`` / ``ParallelStreamingDataset``, the same input directories
    in the same order."""
    where = _input_dirs(loader.dataset)
    for state in states or ():
        dataset = state.get("dataset") if isinstance(state, dict) else None
        if isinstance(dataset, dict) and _state_dirs(dataset) == where:
            return cast(dict[str, Any], state)
    return None


def _input_dirs(dataset: Any) -> list[tuple[Any, Any]]:
    children = getattr(dataset, "_datasets", None)
    if isinstance(children, list):  # LitData's combining datasets take StreamingDatasets only
        return [(c.input_dir.path, c.input_dir.url) for c in children]
    return [(dataset.input_dir.path, dataset.input_dir.url)]


def _state_dirs(dataset: dict[Any, Any]) -> list[tuple[Any, Any]] | None:
    if "input_dir_path" in dataset:  # a StreamingDataset's
        return [(dataset["input_dir_path"], dataset.get("input_dir_url"))]
    dirs = []
    for i in range(len(dataset)):  # a combining one's: "0", "1", ...
        child = dataset.get(str(i))
        if not isinstance(child, dict) or "input_dir_path" not in child:
            return None
        dirs.append((child["input_dir_path"], child.get("input_dir_url")))
    return dirs or None


_COUNTS = ("num_samples_yielded", "current_epoch")  # of a StreamingDataset's state, >= 0
_SIZES = ("num_workers", "batch_size", "world_size")  # >= 1
_OPTIONAL_COUNTS = ("sample_in_epoch", "num_canonical_nodes")
_OPTIONAL_SIZES = ("initial_world_size", "initial_num_workers", "initial_batch_size")


def state_problem(state: dict[str, Any]) -> str | None:
    """What makes ``state`` (a StreamingDataLoader's, as :func:`litdata_state` found it)
    unusable, in words, or ``None``: a hand-edited or truncated entry that LitData (or the
    plan) would fail on with a bare ``KeyError`` / ``TypeError`` deep inside the fit."""
    for key in ("current_epoch", "latest_worker_idx"):
        if not _whole(state.get(key), 0):
            return f"{key}={state.get(key)!r}"
    dataset = state["dataset"]
    if "input_dir_path" in dataset:
        children = [("dataset", dataset)]
        if not _whole(state.get("num_samples_yielded"), 0):
            return f"num_samples_yielded={state.get('num_samples_yielded')!r}"
    else:
        children = [(f"dataset {k}", c) for k, c in dataset.items()]
        if not isinstance(state.get("num_samples_yielded"), dict):
            return f"num_samples_yielded={state.get('num_samples_yielded')!r}"
    for name, child in children:
        for keys, least, optional in (
            (_COUNTS, 0, False),
            (_SIZES, 1, False),
            (_OPTIONAL_COUNTS, 0, True),
            (_OPTIONAL_SIZES, 1, True),
        ):
            for key in keys:
                if not (optional and key not in child) and not _whole(child.get(key), least):
                    return f"{name} {key}={child.get(key)!r}"
        for key in ("seed", "shuffle", "drop_last"):
            if not isinstance(child.get(key), int):  # bools are ints
                return f"{name} {key}={child.get(key)!r}"
    return None


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and value >= least


def elastic(loader: Any, state: dict[str, Any], world: int) -> bool:
    """Whether LitData resumes ``state`` at another topology (as its ``load_state_dict``
    decides): with its elastic plan for a StreamingDataset (also when the state itself came
    from an elastic resume); a combining dataset's it refuses."""
    from litdata.streaming.elastic import topology_changed

    dataset_state = state["dataset"]
    single = "input_dir_path" in dataset_state
    children = [dataset_state] if single else list(dataset_state.values())
    return (single and dataset_state.get("resume_mode") == "elastic") or any(
        topology_changed(
            child,
            world_size=world,
            num_workers=loader.num_workers or 1,
            batch_size=int(loader.batch_size or 1),
        )
        for child in children
    )


def resume_plan(loader: Any, state: dict[str, Any], world: int) -> ResumePlan:
    """What ``loader`` (a StreamingDataLoader over a StreamingDataset, at ``world`` ranks)
    yields of ``state``'s epoch when LitData resumes it elastically: its own plan
    (``StreamingDataset._setup_elastic_resume``) computed for every rank and worker, counting
    samples only (nothing is read)."""
    from litdata.streaming.dataset import _replay_sampling
    from litdata.streaming.elastic import (
        restripe_items,
        sample_in_epoch_from_state,
        topology_changed,
    )
    from litdata.streaming.shuffle import WindowShuffle

    dataset = loader.dataset
    s = state["dataset"]
    workers, batch = max(1, loader.num_workers or 0), int(loader.batch_size or 1)
    stream = _canonical_stream(loader, s, world)
    yielded = int(s.get("num_samples_yielded", 0))
    # at the topology of an elastic resume, LitData keeps that resume's plan and skips what
    # each worker yielded since; otherwise it restripes what no rank trained
    replay = not topology_changed(s, world_size=world, num_workers=workers, batch_size=batch)
    done = sample_in_epoch_from_state(s)
    first = max(0, done - yielded * world) if replay else done
    chunked = isinstance(dataset.shuffler, WindowShuffle)
    plans = restripe_items(
        stream,
        world_size=world,
        num_workers=workers,
        batch_size=batch,
        drop_first=first,
        drop_last=bool(dataset.drop_last),
        granularity="chunk" if chunked else "item",
    )
    skip = _replay_sampling(yielded, int(s.get("batch_size", batch)), workers) if replay else {}
    counts = [
        [max(0, _items(plans[r * workers + w]) - skip.get(w, 0)) for w in range(workers)]
        for r in range(world)
    ]
    whole = math.floor if loader.drop_last else math.ceil  # each worker batches its own
    batches = tuple(sum(whole(n / batch) for n in rank) for rank in counts)
    planned = sum(_items(plan) for plan in plans)
    if chunked:  # whole chunks: the rest of one being read is skipped, nothing is repeated
        start = first
        skipped = 0 if replay else _rest_of_chunk(stream, first)
    else:  # the samples done are rounded down to whole global batches: the rest again
        start = first - first % (world * batch)
        skipped = 0
    common = min(batches, default=0)
    # the samples done again lead what is dealt; drop_last trims its end (all of it, when
    # fewer than the new topology's global batch are left)
    repeated = 0 if replay else min(done - start, planned)
    return ResumePlan(
        batches,
        repeated=repeated,
        skipped=skipped,
        dropped=0 if replay else max(0, len(stream) - done - skipped - (planned - repeated)),
        uneven=sum(b - common for b in batches),
    )


def _canonical_stream(loader: Any, s: dict[str, Any], world: int) -> list[tuple[int, int]]:
    """The saved epoch's samples in LitData's canonical order, as ``(chunk, position)`` pairs
    (counting needs no sample ids): the first run's per-worker assignment, interleaved as its
    ranks and workers took their batches (``StreamingDataset._canonical_plans``)."""
    from litdata.streaming.elastic import lockstep_stream_from_worker_seqs
    from litdata.utilities.env import _DistributedEnv

    workers, batch = max(1, loader.num_workers or 0), int(loader.batch_size or 1)
    len(loader)  # LitData builds its shuffler on the first len()
    init = _DistributedEnv(
        max(1, int(s.get("initial_world_size", s.get("world_size", world)))),
        0,
        max(1, int(s.get("initial_num_nodes", 1))),
    )
    init_workers = max(1, int(s.get("initial_num_workers", s.get("num_workers", workers))))
    init_batch = max(1, int(s.get("initial_batch_size", s.get("batch_size", batch))))
    chunks, intervals = loader.dataset.shuffler.get_chunks_and_intervals_per_workers(
        init, init_workers, init_batch, int(s["current_epoch"])
    )
    seqs = [
        [(int(c), k) for c, i in zip(cs, ivs, strict=True) for k in range(int(i[2]) - int(i[1]))]
        for cs, ivs in zip(chunks, intervals, strict=True)
    ]
    return cast(
        list[tuple[int, int]],
        lockstep_stream_from_worker_seqs(
            seqs, world_size=init.world_size, num_workers=init_workers, batch_size=init_batch
        ),
    )


def _items(plan: list[tuple[int, list[int]]]) -> int:
    return sum(len(items) for _, items in plan)


def _rest_of_chunk(stream: list[tuple[int, int]], first: int) -> int:
    """The samples LitData's chunk-granular resume skips: those of the chunk the stream was in
    at ``first`` (its ``restripe_items(granularity="chunk")``)."""
    if not 0 < first < len(stream) or stream[first - 1][0] != stream[first][0]:
        return 0
    chunk = stream[first][0]
    return sum(1 for c, _ in stream[first:] if c == chunk)


def prepare_state(loader: Any, state: dict[str, Any], world: int) -> None:
    """Two corrections to a state before LitData loads it for an elastic resume (in place).

    * Its ``num_samples_yielded`` (the samples each rank yielded at the saved topology) is
      checked against a whole epoch at the new one, although the elastic plan reads
      ``sample_in_epoch`` only: 2 -> 3 ranks, 200 samples, after 70 of a rank's 100 samples
      its workers raised ``ValueError`` (70 > 64). Set to 0 when the topology changed (what
      LitData's loader itself counts from there).
    * ``resume_mode="elastic"`` is kept in the states it saves next only when the dataset was
      read in the main process: with DataLoader workers, a later resume at the same topology
      replayed the fresh epoch's plan instead of the elastic one (samples twice and never).
    """
    from litdata.streaming.elastic import topology_changed

    s = state["dataset"]
    workers, batch = max(1, loader.num_workers or 0), int(loader.batch_size or 1)
    if "sample_in_epoch" in s and topology_changed(
        s, world_size=world, num_workers=workers, batch_size=batch
    ):
        s["num_samples_yielded"] = 0
    s["resume_mode"] = "elastic"
