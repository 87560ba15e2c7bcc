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

LitData internals relied on here (tested with 0.2.76): ``StreamingDataLoader.restore`` and
``current_epoch``, ``StreamingDataset.distributed_env``, ``input_dir``, ``_datasets`` of its
combining datasets, ``litdata.utilities.env._DistributedEnv``; and those of
:mod:`~lightning_elastic.lightning.litdata_plan` (its :func:`~.litdata_plan.missing` names
what moved).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

from lightning_elastic.errors import ConfigError, DataShardingError
from lightning_elastic.lightning._compat import litdata_children
from lightning_elastic.lightning.litdata_plan import (
    ResumePlan,
    elastic,
    litdata_state,
    prepare_state,
    resume_plan,
)

__all__ = [
    "LitDataFollower",
    "LoopPosition",
    "adopt",
    "check_ranks",
    "is_streaming_loader",
    "streaming_datasets",
]

log = logging.getLogger(__name__)

_FOLLOWER = "_lightning_elastic_litdata"


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
    children = litdata_children(dataset)
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
        # its node count stays: it decides the shuffle, and every rank built it the same way
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
    if state is None or not trainer.fit_loop.restarting:  # Lightning loads no state then
        _continue_epochs(loader, trainer, loop, state)
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


def _continue_epochs(
    loader: Any, trainer: Any, loop: LoopPosition, state: dict[str, Any] | None
) -> None:
    """A resumed fit whose loader gets no state: Lightning loads the loaders' states only into
    a loop that restarts inside an epoch (with ``max_epochs`` training, not after a save at an
    epoch's end). LitData would start over at its epoch 1 (its shuffle of epoch 1 again); it
    continues after the saved state's epoch instead or, without a state, at the loop's epoch
    (the uninterrupted run iterates the loader once per epoch, and LitData counts from 1)."""
    if state is not None:
        epoch = int(state["current_epoch"])  # over: the loop finished its epoch
    elif loop.resumed and not trainer.reload_dataloaders_every_n_epochs:
        epoch = loop.epoch
    else:
        return
    if loader.current_epoch == 0 and epoch > 0:
        loader.current_epoch = epoch  # its next iter() counts one more
        log.debug("LitData loader continues at its epoch %d", epoch + 1)


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
