"""LitData's ``StreamingDataset`` / ``StreamingDataLoader`` resumed through our checkpoints.

LitData keeps its own position: ``StreamingDataLoader.state_dict()`` holds the samples yielded
in the epoch and the topology (ranks, workers, batch size) that yielded them; Lightning saves
it with its loop state and hands it back through ``load_state_dict``. At another topology
LitData deals the samples no rank has trained over the new ranks and workers itself (its
elastic resume). Three things went wrong with LitData 0.2.76 and Lightning, silently:

* **The resumed pass never ended.** After ``load_state_dict`` the loader replays the loaded
  state (its ``restore`` flag) until one pass over it runs to its end; Lightning ends an epoch
  at ``len()`` without exhausting the loader, so the next epoch replayed the finished one: an
  epoch of 0 batches, ``current_epoch`` one ahead of the uninterrupted run, and one more seed
  drawn from the global RNG (losses drift from then on). At the next epoch's start
  (Lightning's ``set_epoch``) the loader is told that the resumed pass is over.
* **The resumed epoch's length at another topology.** Lightning counts the batches its loop
  did before the save plus a whole epoch at the new size; LitData yields only what was left
  (2 -> 3 ranks, 200 samples, batch 4: 15 batches done, 6 left, but 16 counted, so Lightning
  ended the epoch after 1 batch and ran the other 5 as the next epoch). The loader reports the
  resumed epoch's length as the loop counts it (batches done + what LitData will yield,
  computed with LitData's own plan, :func:`resume_plan`), so the epoch ends where its data
  ends; the next epoch is counted anew at the new size.
* **A dataset built before the process group** (e.g. at module level) reads as rank 0: LitData
  reads the rank from ``GLOBAL_RANK``, which torchrun does not set, when no process group exists
  yet. Found at setup (:func:`check_ranks`): fixed when only the rank is wrong, refused
  otherwise.

Where LitData's own elastic resume cannot keep every sample once per epoch, a warning at the
resume says how many samples (see :class:`ResumePlan`).

Which rank calls what: every rank, when Lightning sets up the training data, calls
:func:`check_ranks` (one all-reduce on the strategy's group when a LitData dataset is there)
and :func:`adopt` (local); Lightning then calls ``set_epoch`` at every epoch start, on every
rank (local). Nothing else is collective.

LitData internals relied on (tested with 0.2.76; :func:`missing` names what moved):
``StreamingDataLoader.restore``, ``StreamingDataset.distributed_env`` and ``.shuffler``,
``litdata.utilities.env._DistributedEnv``, ``litdata.streaming.dataset._replay_sampling``,
``litdata.streaming.shuffle.WindowShuffle`` and the pure functions of
``litdata.streaming.elastic``; the state keys of ``StreamingDataset.state_dict``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable
from typing import Any, cast

from lightning_elastic.core._compat import unmet
from lightning_elastic.errors import ConfigError, DataShardingError

__all__ = [
    "REQUIREMENTS",
    "LitDataFollower",
    "LoopPosition",
    "ResumePlan",
    "adopt",
    "check_ranks",
    "is_streaming_loader",
    "missing",
    "resume_plan",
    "streaming_datasets",
]

log = logging.getLogger(__name__)

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
_FOLLOWER = "_lightning_elastic_litdata"


def missing() -> list[str]:
    """The LitData internals this module relies on that the installed LitData lacks (all of
    them when LitData is not installed)."""
    return unmet(REQUIREMENTS)


# ---------------------------------------------------------------------- what is LitData's


def _from_litdata(obj: object, name: str) -> bool:
    return any(
        cls.__name__ == name and cls.__module__.startswith("litdata.") for cls in type(obj).__mro__
    )


def is_streaming_loader(loader: object) -> bool:
    """Whether ``loader`` is LitData's ``StreamingDataLoader`` (or a subclass); LitData is not
    imported to find out."""
    return _from_litdata(loader, "StreamingDataLoader")


def streaming_datasets(dataset: object) -> list[Any]:
    """The LitData ``StreamingDataset`` objects ``dataset`` reads from: itself, or those a
    ``CombinedStreamingDataset`` / ``ParallelStreamingDataset`` combines."""
    if _from_litdata(dataset, "StreamingDataset"):
        return [dataset]
    children = getattr(dataset, "_datasets", None)
    if not type(dataset).__module__.startswith("litdata.") or not isinstance(children, list):
        return []
    return [child for c in children for child in streaming_datasets(c)]


# ---------------------------------------------------------------------- ranks


def check_ranks(
    loader: object, *, rank: int, replicas: int, all_agree: Callable[[bool], bool]
) -> None:
    """Make every LitData dataset of a training ``loader`` read as ``rank`` of ``replicas``.

    A dataset built before the process group existed read its rank from ``GLOBAL_RANK`` (unset
    under torchrun and Lightning's own launcher: rank 0) and its world size from
    ``WORLD_SIZE``. Only the rank wrong: fixed, with a warning (LitData decided nothing else
    from it). The world size wrong as well (Lightning's launcher sets ``WORLD_SIZE`` after rank
    0 started): refused on every rank, since LitData also chose ``drop_last`` from it.

    ``all_agree(ok)`` is True when ``ok`` on every rank (a collective: every rank calls this
    with the same kind of loader).

    Raises:
        DataShardingError: a dataset was set up for another world size (on every rank).
    """
    datasets = streaming_datasets(getattr(loader, "dataset", None))
    if not datasets:
        return
    from litdata.utilities.env import _DistributedEnv

    problem = None
    for dataset in datasets:
        env = dataset.distributed_env
        if (env.world_size, env.global_rank) == (replicas, rank):
            continue
        if env.world_size != replicas:
            problem = (
                f"a LitData StreamingDataset ({dataset.input_dir.path or dataset.input_dir.url}) "
                f"was set up for a world of {env.world_size} (rank {env.global_rank}) and is "
                f"read by rank {rank} of {replicas}"
            )
            continue
        dataset.distributed_env = _DistributedEnv(replicas, rank, env.num_nodes)
        log.warning(
            "the LitData StreamingDataset of %s was set up before the process group existed "
            "and would have read rank %d's samples on rank %d: it now reads rank %d's. Build "
            "it in train_dataloader() or LightningDataModule.setup() (LitData reads the rank "
            "from GLOBAL_RANK, which torchrun does not set, until the process group exists).",
            dataset.input_dir.path or dataset.input_dir.url,
            env.global_rank,
            rank,
            rank,
        )
    if not all_agree(problem is None):
        raise DataShardingError(
            (problem or "another rank's LitData StreamingDataset was set up for another world")
            + ": it was built before the process group existed (LitData then reads the world "
            "size from WORLD_SIZE and the rank from GLOBAL_RANK, and chooses drop_last from "
            "them). Build the StreamingDataset in train_dataloader() or in "
            "LightningDataModule.setup(), where the process group exists."
        )


# ---------------------------------------------------------------------- the resumed epoch


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
    the StreamingDataLoader ``loader``: the one over the same input directory."""
    where = (loader.dataset.input_dir.path, loader.dataset.input_dir.url)
    for state in states or ():
        dataset = state.get("dataset") if isinstance(state, dict) else None
        if (
            isinstance(dataset, dict)
            and "input_dir_path" in dataset  # a StreamingDataset's
            and (dataset["input_dir_path"], dataset.get("input_dir_url")) == where
        ):
            return cast(dict[str, Any], state)
    return None


def elastic(loader: Any, state: dict[str, Any], world: int) -> bool:
    """Whether LitData resumes ``state`` with its elastic plan (as its ``load_state_dict``
    decides: another topology, or the state itself came from an elastic resume)."""
    from litdata.streaming.elastic import topology_changed

    dataset_state = state["dataset"]
    return dataset_state.get("resume_mode") == "elastic" or bool(
        topology_changed(
            dataset_state,
            world_size=world,
            num_workers=loader.num_workers or 1,
            batch_size=int(loader.batch_size or 1),
        )
    )


def resume_plan(loader: Any, state: dict[str, Any], world: int) -> ResumePlan:
    """What ``loader`` (a StreamingDataLoader over a StreamingDataset, at ``world`` ranks)
    yields of ``state``'s epoch when LitData resumes it elastically: its own plan
    (``StreamingDataset._setup_elastic_resume``) computed for every rank and worker, counting
    samples only (nothing is read)."""
    from litdata.streaming.dataset import _replay_sampling
    from litdata.streaming.elastic import (
        lockstep_stream_from_worker_seqs,
        restripe_items,
        sample_in_epoch_from_state,
        topology_changed,
    )
    from litdata.streaming.shuffle import WindowShuffle
    from litdata.utilities.env import _DistributedEnv

    dataset = loader.dataset
    s = state["dataset"]
    workers, batch = max(1, loader.num_workers or 0), int(loader.batch_size or 1)
    len(loader)  # LitData builds its shuffler on the first len()
    shuffler = dataset.shuffler
    init = _DistributedEnv(
        max(1, int(s.get("initial_world_size", s.get("world_size", world)))),
        0,
        max(1, int(s.get("initial_num_nodes", 1))),
    )
    init_workers = max(1, int(s.get("initial_num_workers", s.get("num_workers", workers))))
    init_batch = max(1, int(s.get("initial_batch_size", s.get("batch_size", batch))))
    chunks, intervals = shuffler.get_chunks_and_intervals_per_workers(
        init, init_workers, init_batch, int(s["current_epoch"])
    )
    # the epoch's canonical stream, as (chunk, position) pairs: counting needs no sample ids
    seqs = [
        [(int(c), k) for c, i in zip(cs, ivs, strict=True) for k in range(int(i[2]) - int(i[1]))]
        for cs, ivs in zip(chunks, intervals, strict=True)
    ]
    stream = lockstep_stream_from_worker_seqs(
        seqs, world_size=init.world_size, num_workers=init_workers, batch_size=init_batch
    )
    yielded = int(s.get("num_samples_yielded", 0))
    # at the topology of an elastic resume, LitData keeps that resume's plan and skips what
    # each worker yielded since; otherwise it restripes what no rank trained
    replay = not topology_changed(s, world_size=world, num_workers=workers, batch_size=batch)
    done = sample_in_epoch_from_state(s)
    first = max(0, done - yielded * world) if replay else done
    chunked = isinstance(shuffler, WindowShuffle)
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
        skipped = _rest_of_chunk(stream, first) if not replay else 0
    else:  # the samples done are rounded down to whole global batches: the rest again
        start = first - first % (world * batch)
        skipped = 0
    common = min(batches, default=0)
    return ResumePlan(
        batches,
        repeated=0 if replay else done - start,
        skipped=skipped,
        dropped=max(0, len(stream) - start - skipped - planned),
        uneven=sum(b - common for b in batches),
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


# ---------------------------------------------------------------------- following the loop


class LitDataFollower:
    """Keeps a resumed StreamingDataLoader's epochs where Lightning's loop counts them.

    ``length``: the resumed epoch's length as the loop counts it (``None``: the loader's own
    ``len()``), reported by the loader until the next epoch starts. ``ends_at_start``: nothing
    of the saved epoch is left for this topology; the loaded state is dropped before the first
    batch, so the loop's epoch reads a fresh LitData epoch.

    Lightning calls :meth:`set_epoch` at every epoch start (through the loader's batch
    sampler): at the first epoch after the resumed one, the loader is told its resumed pass is
    over (``restore``: otherwise it replays the loaded state again), its length is LitData's
    own again and the loop is recounted for it.
    """

    def __init__(
        self, loader: Any, trainer: Any, *, length: int | None, ends_at_start: bool
    ) -> None:
        self.loader = loader
        self.length = length
        self.ends_at_start = ends_at_start
        self.resumed_epoch: int | None = None  # the loop's epoch the resumed pass belongs to
        self.done = False
        self._trainer = weakref.ref(trainer)
        self._class = type(loader)

    def install(self) -> None:
        """Route Lightning's ``set_epoch`` here and, with a ``length``, report it as the
        loader's ``len()`` (its class becomes a subclass that asks this object)."""
        from lightning_elastic.lightning.streaming import EpochSignal

        self.loader.batch_sampler.sampler = EpochSignal(self)
        setattr(self.loader, _FOLLOWER, self)
        if self.length is not None:
            self.loader.__class__ = _counted(self._class)

    def set_epoch(self, epoch: int) -> None:
        """Lightning's epoch start (every rank)."""
        if self.done:
            return
        if self.resumed_epoch is None:
            self.resumed_epoch = epoch
            if self.ends_at_start:
                self.loader.restore = False
            return
        if epoch == self.resumed_epoch:
            return
        self.done = True
        self.loader.restore = False  # the next iter() starts a fresh LitData epoch
        if self.length is not None:
            self.length = None
            self.loader.__class__ = self._class
            trainer = self._trainer()
            if trainer is not None:
                from lightning_elastic.lightning.data import sync_training_loop

                sync_training_loop(trainer)


_COUNTED: dict[type, type] = {}


def _counted(cls: type) -> type:
    """``cls`` with a ``__len__`` that reports its follower's ``length``, when it has one."""
    counted = _COUNTED.get(cls)
    if counted is None:

        def __len__(self: Any) -> int:
            follower = self.__dict__.get(_FOLLOWER)
            if follower is not None and follower.length is not None:
                return int(follower.length)
            return int(cls.__len__(self))  # type: ignore[attr-defined]

        counted = type(cls.__name__, (cls,), {"__len__": __len__, "__qualname__": cls.__qualname__})
        _COUNTED[cls] = counted
    return counted


@dataclasses.dataclass(frozen=True)
class LoopPosition:
    """Where Lightning's restored fit loop stands when the training data is set up."""

    epoch: int  # the epoch it runs next (or continues)
    batches: int  # batches of that epoch it counts as done
    last_batch: bool  # the checkpoint was taken on the epoch's last batch
    resumed: bool  # the fit resumed from a checkpoint

    @classmethod
    def of(cls, trainer: Any) -> LoopPosition:
        """The position of ``trainer``'s fit loop (restored before the data is set up)."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return cls(
            epoch=int(trainer.fit_loop.epoch_progress.current.processed),
            batches=int(progress.current.processed),
            last_batch=bool(progress.is_last_batch),
            resumed=trainer.ckpt_path is not None,
        )


def adopt(
    loader: Any,
    trainer: Any,
    *,
    world: int,
    states: list[Any],
    loop: LoopPosition,
    global_batch_size: int | None = None,
) -> LitDataFollower | None:
    """Set up a training StreamingDataLoader of a fit at ``world`` data-parallel ranks:
    ``states`` are the dataloader states Lightning will load (see :func:`litdata_state`),
    ``loop`` where its fit loop stands. Returns the follower of a resumed loader, or ``None``.

    Raises:
        ConfigError: ``global_batch_size`` differs from the loader's batch size times ``world``
            (a StreamingDataLoader cannot be rebuilt with another batch size).
    """
    batch = int(loader.batch_size or 1)
    if global_batch_size is not None and global_batch_size != batch * world:
        raise ConfigError(
            f"global_batch_size={global_batch_size} needs a per-rank batch of "
            f"{global_batch_size / world:g} at world size {world}, but the StreamingDataLoader "
            f"has batch_size={batch}: build it with batch_size=global_batch_size // world_size "
            "in train_dataloader() (it cannot be rebuilt with another batch size)"
        )
    state = litdata_state(loader, states)
    if state is None:
        _follow_the_loops_epoch(loader, trainer, loop)
        return None
    length, ends_at_start = None, False
    if streaming_datasets(loader.dataset) == [loader.dataset] and elastic(loader, state, world):
        plan = resume_plan(loader, state, world)
        prepare_state(loader, state, world)
        if plan.common == 0 or loop.last_batch:  # nothing of the saved epoch is left
            ends_at_start = True
            fresh = len(loader)
            if not loop.last_batch:
                length = loop.batches  # the loop ends the epoch at once, without a batch
            elif loop.batches >= fresh:
                length = fresh  # the loop starts a new epoch at batch 0
            else:  # it counts on from `batches` over a whole epoch (see ElasticSampler._settle)
                length = loop.batches + fresh
        else:
            length = loop.batches + plan.common
        if trainer.global_rank == 0:
            _report(plan, state, world, loader, length)
    follower = LitDataFollower(loader, trainer, length=length, ends_at_start=ends_at_start)
    follower.install()
    return follower


def _follow_the_loops_epoch(loader: Any, trainer: Any, loop: LoopPosition) -> None:
    """A resumed fit whose loader gets no state (Lightning loads none when the checkpoint was
    taken after an epoch ended): LitData would start over at its first epoch (its shuffle of
    epoch 1 again); it continues at the loop's epoch instead, as the uninterrupted run, where
    Lightning iterates the loader once per epoch and LitData counts its epochs from 1."""
    if (
        loop.resumed
        and loop.epoch > 0
        and loader.current_epoch == 0
        and not trainer.reload_dataloaders_every_n_epochs
    ):
        loader.current_epoch = loop.epoch  # its next iter() counts one more
        log.debug("LitData loader continues at its epoch %d", loop.epoch + 1)


def _report(
    plan: ResumePlan,
    state: dict[str, Any],
    world: int,
    loader: Any,
    length: int,
) -> None:
    """The resume in one line (rank 0), and a warning when samples are not trained once."""
    s = state["dataset"]
    saved = (s.get("world_size"), s.get("num_workers"), s.get("batch_size"))
    log.info(
        "LitData resumes its epoch %s, saved at %s rank(s) x %s worker(s) x batch %s, at %d x "
        "%d x %d: %d batch(es) per rank left, the loop's epoch ends after batch %d%s",
        s.get("current_epoch"),
        *saved,
        world,
        max(1, loader.num_workers or 0),
        int(loader.batch_size or 1),
        plan.common,
        length,
        f"; {plan.dropped} sample(s) cut by drop_last" if plan.dropped else "",
    )
    problems = []
    if plan.repeated:
        problems.append(
            f"{plan.repeated} sample(s) trained before the save are dealt again (LitData resumes "
            "at a whole number of global batches of the new topology)"
        )
    if plan.skipped:
        problems.append(
            f"{plan.skipped} sample(s) of a partly read chunk are skipped (LitData's window "
            "shuffle resumes whole chunks)"
        )
    if plan.uneven:
        problems.append(
            f"{plan.uneven} batch(es) of ranks that got more than the others are left out, so "
            "that every rank runs the same number of batches (drop_last=False)"
        )
    if problems:
        log.warning(
            "LitData's elastic resume cannot train every sample of epoch %s once at the new "
            "topology: %s. Resume at the saved topology (%s rank(s), %s worker(s), batch %s) "
            "for an exact continuation; see docs/streaming.md.",
            s.get("current_epoch"),
            "; ".join(problems),
            *saved,
        )
