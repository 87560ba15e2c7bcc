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
* **A dataset built before the process group** (e.g. at module level) reads as rank 0: see
  :mod:`~lightning_elastic.lightning.litdata_ranks`.

Where LitData's own elastic resume cannot keep every sample once per epoch, a warning at the
resume says how many samples (see :class:`ResumePlan`).

A state is not given to LitData (:func:`adopt` withholds it from ``load_state_dict``) when
LitData would replay or refuse it: one saved at the end of an epoch that did not run LitData's
pass to its end (``limit_train_batches``: LitData replayed the rest of that pass as the next
epoch), one of a ``CombinedStreamingDataset`` / ``ParallelStreamingDataset`` at another
topology (LitData raises ``ValueError``: an elastic job could never restart), one that is not
this loader's (the checkpoint was written with another training dataloader) and one that is
unreadable (hand-edited or truncated; LitData failed with a bare ``KeyError`` or
``TypeError``). The interrupted epoch then starts over, with a warning saying what it costs.

Which rank calls what: every rank, when Lightning sets up the training data, calls
:func:`adopt` (local, after :func:`~.litdata_ranks.check_ranks`); Lightning then calls
``set_epoch`` at every epoch start, on every rank (local). Nothing here is collective.

LitData internals relied on here (tested with 0.2.76): ``StreamingDataLoader.restore``,
``current_epoch`` and ``load_state_dict``, ``StreamingDataset.input_dir``, ``_datasets`` of its
combining datasets; and those of
:mod:`~lightning_elastic.lightning.litdata_plan` (its :func:`~.litdata_plan.missing` names
what moved).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from lightning_elastic.errors import ConfigError, WorldSizeError
from lightning_elastic.lightning.litdata_plan import (
    ResumePlan,
    elastic,
    litdata_state,
    prepare_state,
    resume_plan,
    state_problem,
)
from lightning_elastic.lightning.litdata_ranks import streaming_datasets

__all__ = [
    "LitDataFollower",
    "LoopPosition",
    "adopt",
    "warn_leftover_sigint",
    "warn_not_resumable",
]

log = logging.getLogger(__name__)

_FOLLOWER = "_lightning_elastic_litdata"


_WARNED: set[str] = set()  # loader classes warned about, once per process


def warn_not_resumable(loader: object) -> None:
    """A LitData dataset read through another loader than LitData's (a torch ``DataLoader``):
    nothing keeps its position, so say so once, with what to use instead."""
    kind = type(loader).__name__
    if kind in _WARNED:
        return
    _WARNED.add(kind)
    log.warning(
        "the training dataloader (%s over a LitData %s) cannot resume within an epoch: "
        "nothing saves its position, so after a resume the epoch starts over from its first "
        "batch and samples are trained twice or, at another world size, skipped. Build it "
        "as litdata.StreamingDataLoader (exact at the same topology, LitData's elastic "
        "resume at another); see docs/streaming.md.",
        kind,
        type(getattr(loader, "dataset", None)).__name__,
    )


def warn_leftover_sigint() -> None:
    """LitData's ``optimize()`` (0.2.76) leaves its SIGINT handler in the process when it
    returns, and that handler ends the process with ``os._exit(0)``: a Ctrl-C then skips
    Lightning's graceful shutdown and every exit handler, and the exit code says success
    (torchrun counts the worker as done). Say so once per process; the handler is the
    user's process state, so it is not replaced here."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    owner = getattr(handler, "__self__", None)
    module = getattr(type(owner), "__module__", None)
    if not (isinstance(module, str) and module.startswith("litdata.")) or "sigint" in _WARNED:
        return
    _WARNED.add("sigint")
    log.warning(
        "LitData's optimize() left its SIGINT handler (%s.%s) in this process: a Ctrl-C "
        "will end it at once with exit code 0 - no graceful shutdown, no exit handlers, and "
        "a launcher counts it as a success. Run optimize() in another process, or put the "
        "handler back after it: signal.signal(signal.SIGINT, signal.default_int_handler).",
        type(owner).__name__,
        getattr(handler, "__name__", "?"),
    )


# ---------------------------------------------------------------------- following the loop


class LitDataFollower:
    """Keeps a resumed StreamingDataLoader's epochs where Lightning's loop counts them.

    ``length``: the resumed epoch's length as the loop counts it (``None``: the loader's own
    ``len()``), reported by the loader until the next epoch starts. ``ends_at_start``: the
    loop starts the next epoch; the loaded state is dropped before the first batch, so that
    epoch reads a fresh LitData epoch. ``empty``: nothing of the saved epoch is left for this
    topology; the loader's first pass yields nothing, so the loop ends the epoch there (and
    ``empty()`` runs where its first batch would be fetched).

    Lightning calls :meth:`set_epoch` at every epoch start (through the loader's batch
    sampler): at the first epoch after the resumed one, the loader is told its resumed pass is
    over (``restore``: otherwise it replays the loaded state again), its length is LitData's
    own again and the loop is recounted for it.
    """

    def __init__(
        self,
        loader: Any,
        trainer: Any,
        *,
        length: int | None,
        ends_at_start: bool,
        empty: Callable[[], None] | None = None,
    ) -> None:
        self.loader = loader
        self.length = length
        self.ends_at_start = ends_at_start
        self.empty = empty
        self.resumed_epoch: int | None = None  # the loop's epoch the resumed pass belongs to
        self.done = False
        self._trainer = weakref.ref(trainer)
        self._class = type(loader)

    def install(self) -> None:
        """Route Lightning's ``set_epoch`` here and, with a ``length``, report it as the
        loader's ``len()`` (its class becomes a subclass that asks this object, also whether
        its next pass is ``empty``)."""
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
    """``cls`` with a ``__len__`` that reports its follower's ``length``, when it has one, and
    an ``__iter__`` that yields nothing when its follower says the pass is ``empty``."""
    counted = _COUNTED.get(cls)
    if counted is None:

        def __len__(self: Any) -> int:
            follower = self.__dict__.get(_FOLLOWER)
            if follower is not None and follower.length is not None:
                return int(follower.length)
            return int(cls.__len__(self))  # type: ignore[attr-defined]

        def __iter__(self: Any) -> Any:
            follower = self.__dict__.get(_FOLLOWER)
            if follower is not None and follower.empty is not None:
                at_fetch, follower.empty = follower.empty, None
                return _empty_pass(at_fetch)
            return cls.__iter__(self)  # type: ignore[attr-defined]

        counted = type(
            cls.__name__,
            (cls,),
            {"__len__": __len__, "__iter__": __iter__, "__qualname__": cls.__qualname__},
        )
        _COUNTED[cls] = counted
    return counted


def _empty_pass(at_fetch: Callable[[], None]) -> Iterator[Any]:
    at_fetch()  # where the loop asks for the first batch
    yield from ()


def _nothing() -> None:
    pass


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
    at_empty_pass: Callable[[], None] | None = None,
) -> LitDataFollower | None:
    """Set up a training StreamingDataLoader of a fit at ``world`` data-parallel ranks:
    ``states`` are the dataloader states Lightning will load (see :func:`litdata_state`),
    ``loop`` where its fit loop stands. Returns the follower of a resumed loader, or ``None``.
    ``at_empty_pass()`` runs where the first resumed batch would start when the resumed epoch
    has none left at this topology (the loop ends it there).

    A state LitData cannot resume is not given to it (the interrupted epoch starts over, with
    a warning): one it refuses (a combining dataset at another topology), one that is not
    this loader's (the checkpoint was written with another training dataloader) or one that
    is unreadable (hand-edited or truncated).

    Raises:
        ConfigError: ``global_batch_size`` differs from the loader's batch size times ``world``
            (a StreamingDataLoader cannot be rebuilt with another batch size).
    """
    _check_batch(loader, world, global_batch_size)
    state = litdata_state(loader, states)
    problem = None if state is None else state_problem(state)
    if not trainer.fit_loop.restarting:  # Lightning loads no state then
        _continue_epochs(loader, trainer, loop, None if problem else state)
        return None
    if state is None or problem is not None:
        if states:  # Lightning gives this loader one of them
            why = f"unreadable: {problem}" if problem else _not_ours(loader)
            _ignore_state(loader, trainer, loop, why, None)
        else:
            _continue_epochs(loader, trainer, loop, None)
        return None
    if loop.batches == 0:
        # the loop starts an epoch: the state is of the one before, saved at its end but not
        # run to LitData's end (limit_train_batches): LitData would go on replaying it
        _withhold(loader, lambda: _continue_epochs(loader, trainer, loop, state))
        return None
    single = streaming_datasets(loader.dataset) == [loader.dataset]
    changed = elastic(loader, state, world)
    if not single and changed:  # LitData resumes these at the saved topology only
        _ignore_state(loader, trainer, loop, _refused(state, loader, world), state)
        return None
    length, ends_at_start, empty = None, False, False
    if single and changed:
        plan = resume_plan(loader, state, world)
        prepare_state(loader, state, world)
        length, ends_at_start, empty = _elastic_epoch(loader, loop, plan)
        if trainer.global_rank == 0:
            _report(plan, state, world, loader, loop.batches if empty else length, loop.epoch)
    follower = LitDataFollower(
        loader,
        trainer,
        length=length,
        ends_at_start=ends_at_start,
        empty=(at_empty_pass or _nothing) if empty else None,
    )
    follower.install()
    return follower


def _elastic_epoch(loader: Any, loop: LoopPosition, plan: ResumePlan) -> tuple[int, bool, bool]:
    """The resumed epoch's length as the loop counts it at the new topology, whether the loop
    starts the next epoch (``ends_at_start``) and whether nothing is left of this one
    (``empty``)."""
    if loop.last_batch:  # Lightning starts the next epoch (a save at this one's end)
        fresh = len(loader)
        # a new epoch at batch 0 or, counting on from `batches`, over a whole epoch (see
        # ElasticSampler._settle)
        return (fresh if loop.batches >= fresh else loop.batches + fresh), True, False
    if plan.common == 0:
        # nothing of the saved epoch is left here: the loop's epoch ends without a batch (an
        # empty pass). Reporting `batches` as its length instead made Lightning start the
        # epoch over (a restart with every batch done resets its batch counter), and the next
        # LitData epoch ran as the rest of this one: 88 of 96 samples twice
        return loop.batches + 1, False, True
    return loop.batches + plan.common, False, False


def _check_batch(loader: Any, world: int, global_batch_size: int | None) -> None:
    batch = int(loader.batch_size or 1)
    if global_batch_size is None or global_batch_size == batch * world:
        return
    if global_batch_size % world:
        raise WorldSizeError(
            f"global_batch_size={global_batch_size} is not divisible by the world size {world}; "
            "choose a multiple of every world size you may run with (e.g. a multiple of 6 for "
            "1, 2 or 3 processes)"
        )
    raise ConfigError(
        f"global_batch_size={global_batch_size} needs a per-rank batch of "
        f"{global_batch_size // world} at world size {world}, but the StreamingDataLoader "
        f"has batch_size={batch}: build it with batch_size=global_batch_size // world_size "
        "in train_dataloader() (it cannot be rebuilt with another batch size)"
    )


def _not_ours(loader: Any) -> str:
    dirs = [d.input_dir.path or d.input_dir.url for d in streaming_datasets(loader.dataset)]
    return (
        f"none of its training dataloader states reads {', '.join(map(str, dirs))}: it was "
        "written with another dataloader or data"
    )


def _refused(state: dict[str, Any], loader: Any, world: int) -> str:
    first = next(iter(state["dataset"].values()))
    return (
        f"LitData resumes a {type(loader.dataset).__name__} only at the topology it was saved "
        f"at ({first['world_size']} rank(s) x {first['num_workers']} worker(s) x batch "
        f"{first['batch_size']}; now {world} x {max(1, loader.num_workers or 0)} x "
        f"{int(loader.batch_size or 1)})"
    )


def _withhold(loader: Any, instead: Callable[[], None]) -> None:
    """The state Lightning hands ``loader`` next is not given to LitData: ``instead()`` runs
    in its place (once; LitData's ``load_state_dict`` is the loader's own again)."""

    def load_state_dict(state: dict[str, Any]) -> None:
        del loader.load_state_dict
        instead()

    loader.load_state_dict = load_state_dict


def _ignore_state(
    loader: Any, trainer: Any, loop: LoopPosition, why: str, state: dict[str, Any] | None
) -> None:
    """The state Lightning will hand ``loader`` is not given to LitData: the loop's epoch
    reads LitData's epoch (the saved one, when readable) from its start."""
    saved = None if state is None else int(state["current_epoch"])

    def ignored() -> None:
        if saved is not None and saved > 0:
            loader.current_epoch = saved - 1  # its next iter() starts the saved epoch over
        else:
            _continue_epochs(loader, trainer, loop, None)
        if trainer.global_rank == 0:
            log.warning(
                "the training StreamingDataLoader's state in the checkpoint is not resumed "
                "(%s): its epoch starts over, while the loop counts the %d batch(es) it did "
                "of epoch %d before the save, so samples trained before it may be trained again "
                "and others not in that epoch. Resume at the saved topology with the saved "
                "dataloader for an exact continuation; see docs/streaming.md.",
                why,
                loop.batches,
                loop.epoch,
            )

    _withhold(loader, ignored)


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
    epoch: int,
) -> None:
    """The resume in one line (rank 0), and a warning when samples are not trained once
    (``epoch``: the loop's, which LitData counts from 1 instead of 0)."""
    s = state["dataset"]
    saved = (s.get("world_size"), s.get("num_workers"), s.get("batch_size"))
    log.info(
        "LitData resumes the loop's epoch %d (LitData's epoch %s), saved at %s rank(s) x %s "
        "worker(s) x batch %s, at %d x %d x %d: %d batch(es) per rank left, the loop's epoch "
        "ends after batch %d%s",
        epoch,
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
            "LitData's elastic resume cannot train every sample of epoch %d (LitData's epoch "
            "%s) once at the new topology: %s. Resume at the saved topology (%s rank(s), %s "
            "worker(s), batch %s) for an exact continuation; see docs/streaming.md.",
            epoch,
            s.get("current_epoch"),
            "; ".join(problems),
            *saved,
        )
