"""What the callback and the strategy share for one Trainer: the checkpoint coordinator,
engines, and the state to hand back after a resume (RNG, data position, metric states).

Saved per checkpoint (through the engine):

* replicated: Lightning's own checkpoint dict (model, optimizers, schedulers, loops,
  callbacks, precision plugin, datamodule, hyperparameters) plus ``"lightning_elastic"``:
  the data position and the world size that wrote it;
* per rank: RNG states (Python, NumPy, torch, CUDA), torchmetrics states, what ``self.log``
  left behind (``trainer.callback_metrics`` and the epoch's accumulators, see
  :mod:`~lightning_elastic.lightning.logged`), and every entry of Lightning's dict whose value
  differs between ranks (a stateful dataloader's position in its own shard, a callback's
  per-rank counter), found by comparing digests at every save;
* manifest metadata: reason, step, epoch, JSON-safe hyperparameters, the LightningCLI
  configuration (resolved), and the topology.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.elastic import rng
from lightning_elastic.core.elastic.data_position import DataPosition
from lightning_elastic.core.engine import CheckpointEngine, SaveHandle
from lightning_elastic.core.format.optimizer_state import is_named, named_to_positional
from lightning_elastic.core.load.load import LoadResult, read_rank_states
from lightning_elastic.core.save.snapshot import guarded_tensors
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    PerRankStateError,
    Phase,
)
from lightning_elastic.lightning import logged
from lightning_elastic.lightning._compat import (
    dump_checkpoint,
    finish_fit_loop_restart,
    pending_loader_states,
    training_epoch_open,
)
from lightning_elastic.lightning.loader_states import LoaderStates
from lightning_elastic.lightning.per_rank import HINT, per_rank_rules
from lightning_elastic.lightning.torchmetrics_state import (
    fold_metric_states,
    metric_states,
    reset_metrics,
    restore_metric_states,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elastic.lightning.data import FollowsTheLoop

__all__ = ["ELASTIC_KEY", "ElasticSession", "ResumeCost", "is_our_strategy"]

log = logging.getLogger(__name__)
ELASTIC_KEY = "lightning_elastic"
_ATTR = "_lightning_elastic_session"


@dataclasses.dataclass(frozen=True)
class ResumeCost:
    """What loading the checkpoint a fit resumed from cost this rank: ``seconds`` from the start
    of checkpoint selection until Lightning's checkpoint dict was ready (selection, verification,
    reading and resharding; ``selection_s`` is what is left of it after ``verify_s`` and
    ``read_s``), and the bytes read."""

    location: str
    step: int
    seconds: float
    verify_s: float
    read_s: float
    bytes_read: int

    @property
    def selection_s(self) -> float:
        """Seconds spent choosing the checkpoint (what is left after verification and read)."""
        return max(0.0, self.seconds - self.verify_s - self.read_s)

    def describe(self) -> str:
        """One line for the log: the seconds, split, and the MiB read."""
        return (
            f"{self.seconds:.2f} s (selection {self.selection_s:.2f} s, verification "
            f"{self.verify_s:.2f} s, read {self.read_s:.2f} s, {self.bytes_read / 2**20:.1f} MiB)"
        )


class ElasticSession:
    """Per-trainer state (attached to ``trainer.strategy``); see :meth:`of`."""

    def __init__(self, trainer: pl.Trainer, timeout: timedelta) -> None:
        self.trainer = trainer
        self.timeout = timeout
        self.coordinator: Coordinator | None = None
        self.engines: dict[str, CheckpointEngine] = {}
        self.sampler: FollowsTheLoop | None = None  # ElasticSampler, ElasticShardedIterable
        self.pending_position: DataPosition | None = None
        self.pending_rank_state: dict[str, Any] | None = None
        self.resumed: LoadResult | None = None
        self.resume_cost: ResumeCost | None = None
        self._config: str | bool | None = False  # False: not looked up yet
        # fsspec options of every checkpoint location this trainer opens (the strategy's; the
        # callback sets them again from its deprecated spelling, see checkpoint_options.py):
        # never open a checkpoint without the credentials
        self.storage_options: dict[str, Any] = dict(
            getattr(trainer.strategy, "storage_options", None) or {}
        )
        self.global_batch_size: int | None = None  # set by ElasticStrategy
        # unpickle checkpoint objects without the safe-loading allowlist (the strategy's
        # trusted=True, or the callback's deprecated spelling of it)
        self.trusted = bool(getattr(trainer.strategy, "trusted", False))
        # the callback was given a run_name: auto-resume considers only that run
        self.named_run = False
        # the engine the checkpoint callback writes with: loading through it for fit takes
        # the run over (its lease); loading elsewhere or to evaluate never does
        self.writer: CheckpointEngine | None = None
        self.loader_states = LoaderStates()  # as of the last batch trained, for saves

    @classmethod
    def of(cls, trainer: pl.Trainer, timeout: timedelta = timedelta(minutes=10)) -> ElasticSession:
        """The session of ``trainer``, created and attached to its strategy on first use (or when
        the strategy's belongs to another trainer)."""
        session = getattr(trainer.strategy, _ATTR, None)
        if session is None or session.trainer is not trainer:
            session = cls(trainer, timeout)
            setattr(trainer.strategy, _ATTR, session)
        return session

    # ------------------------------------------------------------------ plumbing

    def ensure_coordinator(self) -> Coordinator:
        """Create the dedicated gloo group on first use: every rank must call this together."""
        if self.coordinator is None:
            self.coordinator = Coordinator.from_environment(timeout=self.timeout)
        return self.coordinator

    def engine(self, root: str, **options: Any) -> CheckpointEngine:
        """The engine for ``root`` (created collectively on first use, then reused), with
        the session's storage options unless ``storage_options`` is given."""
        key = str(root)
        options.setdefault("storage_options", self.storage_options)
        if key not in self.engines:
            self.engines[key] = CheckpointEngine(
                root, coordinator=self.ensure_coordinator(), timeout=self.timeout, **options
            )
        return self.engines[key]

    def close(self) -> None:
        """Close every engine and the coordinator; then raise the first error an engine raised,
        if any."""
        errors = []
        for engine in self.engines.values():
            try:
                engine.close()
            except Exception as exc:  # close every engine, then report
                errors.append(exc)
        self.engines.clear()
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ saving

    def save(
        self,
        engine: CheckpointEngine,
        *,
        reason: str,
        blocking: bool | None = None,
        name: str | None = None,
        overwrite: bool = False,
        metrics: Mapping[str, float] | None = None,
        checkpoint: dict[str, Any] | None = None,
    ) -> SaveHandle | None:
        """Save the trainer's full state (every rank calls this together). Multi-tier: the
        save at the end of a fit or on a signal is persisted."""
        trainer = self.trainer
        if checkpoint is None:
            checkpoint = dump_checkpoint(trainer)
        if _in_training(trainer):  # the loop may have fetched the next batch already
            checkpoint = self.loader_states.apply(checkpoint)
        position = self.data_position()
        world = self.ensure_coordinator().world_size
        state = dict(checkpoint)
        state[ELASTIC_KEY] = {
            "world_size": world,
            "position": None if position is None else dataclasses.asdict(position),
        }
        replicas = getattr(trainer.strategy, "replica_checkpoint_state", None)
        if callable(replicas) and (replica_state := replicas()) is not None:
            state[ELASTIC_KEY]["replicas"] = replica_state  # elastic_ft: the shared data queue
        metadata: dict[str, Any] = {
            "reason": reason,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "topology": topology(world),
            "hparams": _jsonable(getattr(trainer.lightning_module, "hparams", {})),
        }
        config = self.config_yaml()
        if config is not None:
            metadata["config"] = config
        return engine.save(
            state,
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            metrics=metrics,
            metadata=metadata,
            rank_state={
                "rng": rng.capture(),
                "metrics": metric_states(trainer.lightning_module),
                logged.RANK_STATE_KEY: logged.capture(trainer),
            },
            name=name,
            overwrite=overwrite,
            blocking=blocking,
            persist=reason == "train_end" or reason.startswith("signal"),
            # what the optimizer step guard (the callback's on_before_optimizer_step) protects
            guarded=(
                guarded_tensors([trainer.lightning_module], trainer.optimizers)
                if engine.snapshot == "lazy"
                else None
            ),
        )

    def data_position(self) -> DataPosition | None:
        """Where the training epoch stands, from the loop's own batch counter."""
        sampler = self.sampler
        trainer = self.trainer
        if sampler is None or not _in_training(trainer):
            return None
        batches = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)  # type: ignore[attr-defined]
        position = sampler.position(batches)
        remaining = len(sampler) - batches * sampler.batch_size
        if remaining <= 0 or batches >= trainer.num_training_batches:
            # the epoch is complete (its data, or the loop's limit_train_batches): resume at
            # the start of the next one; the loop's counter goes along, since Lightning keeps
            # counting from it when the next epoch is longer (see ElasticSampler.resume)
            return DataPosition(
                epoch=position.epoch + 1,
                consumed=0,
                world_size=position.world_size,
                batches=batches,
            )
        return position

    def config_yaml(self) -> str | None:
        """The LightningCLI configuration (resolved), when the run was started by one."""
        if self._config is False:
            self._config = None
            for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
                parser = getattr(callback, "parser", None)
                config = getattr(callback, "config", None)
                if parser is not None and config is not None and hasattr(parser, "dump"):
                    try:
                        self._config = str(parser.dump(config, skip_none=False, skip_check=True))
                    except Exception as exc:  # the config is informative only
                        log.warning("could not serialize the LightningCLI config: %r", exc)
                    break
        return self._config if isinstance(self._config, str) else None

    # ------------------------------------------------------------------ loading

    def load(
        self, engine: CheckpointEngine, *, name: str | None, verify: str
    ) -> dict[str, Any] | None:
        """Load a checkpoint (``name``, or the newest valid one) for the trainer to restore.

        Returns Lightning's checkpoint dict, or ``None`` when ``name`` is None and there is no
        valid checkpoint. Per-rank state is kept and handed back at the first training batch;
        entries of Lightning's dict that differed between ranks come back per rank, or, at
        another world size, as :mod:`~lightning_elastic.lightning.per_rank` decides.
        """
        # a sharded strategy (elastic_fsdp) says where its tensors go: DCP reads each rank's
        # shards straight into its DTensors instead of every rank loading full tensors
        targets_of = getattr(self.trainer.strategy, "checkpoint_targets", None)
        began = time.perf_counter()
        try:
            result = engine.load(
                None,
                checkpoint=name,
                verify=verify,
                trusted=self.trusted,
                per_rank_rules=per_rank_rules(self.trainer),
                skip_named_runs=True,  # only reaches the search when name is None: auto-resume
                targets=targets_of() if callable(targets_of) else None,
            )
        except CheckpointNotFoundError:
            if name is not None:
                raise
            return None
        except PerRankStateError as exc:  # say what to do in Lightning's words
            hint = HINT.format(saved=exc.saved_world_size)
            raise PerRankStateError(
                exc.checkpoint, exc.paths, exc.saved_world_size, exc.world_size, hint
            ) from None
        assert result.state is not None
        checkpoint = result.state
        location = result.info.location
        module = self.trainer.lightning_module
        auto = name is None
        redo = (
            "pass resume='never', another dirpath or a new run_name to start a new run"
            if auto
            else "pass the checkpoint of this model"
        )
        if isinstance(checkpoint.get("state_dict"), Mapping):
            mismatch = model_mismatch(
                checkpoint["state_dict"],
                module.state_dict(),
                keys=getattr(module, "strict_loading", True),
            )
            if mismatch is not None:
                raise CheckpointMismatchError(
                    f"checkpoint at {location} was written by a different model (first "
                    f"mismatch: {mismatch}); {redo}"
                )
        fitting = self.trainer.state.fn == "fit"
        if auto:
            self._check_same_experiment(result)
        replica_groups = hasattr(self.trainer.strategy, "replica_checkpoint_state")
        if fitting and engine is self.writer and not replica_groups:
            # this job continues the run: from now on an older copy of it may not commit
            # (elastic_ft: other groups may be training; the leader group takes the lease
            # when it first saves)
            engine.take_over()
        if "optimizer_states" in checkpoint and not is_our_strategy(self.trainer.strategy):
            # a strategy of Lightning's own: name-keyed (ZeRO-1, FSDP) optimizer states made
            # plain, for Optimizer.load_state_dict
            checkpoint["optimizer_states"] = [
                named_to_positional(s) if is_named(s) else s
                for s in checkpoint.get("optimizer_states") or []
            ]
        elastic = checkpoint.pop(ELASTIC_KEY, None) or {}
        saved_world = int(elastic.get("world_size") or result.manifest.world_size)
        world = self.ensure_coordinator().world_size
        position = elastic.get("position")
        self.pending_position = DataPosition(**position) if position else None
        restore_replicas = getattr(self.trainer.strategy, "restore_replica_checkpoint_state", None)
        if callable(restore_replicas) and fitting:
            restore_replicas(elastic.get("replicas"))
        self.pending_rank_state = result.rank_state or {}
        self.resumed = result
        if saved_world != world and fitting:
            # metric accumulators of all saved ranks are folded into rank 0; others start empty
            metrics: dict[str, Any] = {}
            if self.ensure_coordinator().rank == 0:
                per_rank = read_rank_states(
                    engine.load_storage, result.info, "metrics", trusted=self.trusted
                )
                metrics = fold_metric_states(self.trainer.lightning_module, list(per_rank.values()))
            self.pending_rank_state["metrics"] = metrics
            self.pending_rank_state["reset_metrics"] = True
            self.pending_rank_state[logged.RANK_STATE_KEY] = self._fold_logged(engine, result)
            log.warning(
                "resuming %s, written by a world of %d, in a world of %d: the epoch's remaining "
                "samples are redistributed and new ranks derive their RNG from the seed",
                result.info.location,
                saved_world,
                world,
            )
        if auto and self.ensure_coordinator().rank == 0:
            self._announce(engine, result, saved_world, world, _epochs_done(checkpoint))
        saved_topology = result.manifest.metadata.get("topology")
        if saved_topology is not None and saved_topology != topology(world):
            log.info("topology changed: was %s, now %s", saved_topology, topology(world))
        self.resume_cost = ResumeCost(
            location=str(result.info.location),
            step=int(result.manifest.step),
            seconds=time.perf_counter() - began,
            verify_s=float(result.verify_s),
            read_s=float(result.load_s),
            bytes_read=int(result.bytes_read),
        )
        if self.ensure_coordinator().rank == 0:
            log.info("loaded %s in %s", result.info.location, self.resume_cost.describe())
        return checkpoint

    def _fold_logged(self, engine: CheckpointEngine, result: LoadResult) -> Any:
        """At another world size: this rank's part of the saved ranks' logged values and
        accumulators, folded on rank 0 and broadcast (every rank calls this together);
        ``None`` for a checkpoint that saved none."""
        coordinator = self.ensure_coordinator()

        def read_and_fold() -> Any:
            per_rank = read_rank_states(
                engine.load_storage, result.info, logged.RANK_STATE_KEY, trusted=self.trusted
            )
            if not per_rank:
                return None
            try:
                return logged.fold([per_rank[rank] for rank in sorted(per_rank)])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # malformed
                log.warning("the saved logged metrics cannot be folded (%r): not restored", exc)
                return None

        folded = coordinator.broadcast(
            Phase.LOAD,
            read_and_fold,
            what=f"{result.info.location} (logged metrics)",
            error=CheckpointLoadError,
        )
        return None if folded is None else folded[0 if coordinator.rank == 0 else 1]

    def _check_same_experiment(self, result: LoadResult) -> None:
        """Auto-resume with other hyperparameters than the run was written with: say so, on
        rank 0 (a warning, not a refusal: an elastic restart must never crash-loop on a
        hyperparameter that legitimately differs between attempts, such as a path or a
        timestamp)."""
        if self.ensure_coordinator().rank != 0:
            return
        saved = result.manifest.metadata.get("hparams")
        current = _jsonable(getattr(self.trainer.lightning_module, "hparams", {}))
        difference = hparams_difference(saved, current)
        if difference is not None:
            log.warning(
                "resume='auto' continues %s (run %r, step %d), written with other "
                "hyperparameters (%s): if this is another experiment, pass a new run_name, "
                "another dirpath or resume='never'",
                result.info.location,
                result.info.run_id,
                result.manifest.step,
                difference,
            )

    def _announce(
        self,
        engine: CheckpointEngine,
        result: LoadResult,
        saved_world: int,
        world: int,
        epochs_done: int,
    ) -> None:
        """The loud line of an automatic resume: what is resumed, from where and why, and a
        word when there is nothing left to train."""
        manifest, trainer = result.manifest, self.trainer
        age = max(0.0, time.time() - float(manifest.created_unix or 0.0))
        where = engine.storage.display()
        tiers = engine.last_recovery
        if tiers is not None:  # multi-tier: the union of the nodes' local roots and dirpath
            where = f"{where} or the node-local roots (this node's copy came from {tiers.tier})"
        log.warning(
            "resume='auto': continuing run %r from %s (step %d, epoch %d, written %s ago by %d "
            "process(es), now %d): it is the newest valid checkpoint%s in %s. Pass "
            "resume='never', another dirpath or a new run_name to start a new run instead.",
            result.info.run_id,
            result.info.location,
            manifest.step,
            epochs_done,
            _duration(age),
            saved_world,
            world,
            " of this run_name" if self.named_run else "",
            where,
        )
        max_steps = trainer.max_steps
        max_epochs = trainer.max_epochs
        reached = []
        if max_steps is not None and max_steps >= 0 and manifest.step >= max_steps:
            reached.append(f"max_steps={max_steps}")
        if max_epochs is not None and max_epochs >= 0 and epochs_done >= max_epochs:
            reached.append(f"max_epochs={max_epochs}")
        if reached:
            log.warning(
                "the checkpoint resumed from is at step %d after %d complete epoch(s): %s "
                "already reached, so this fit trains nothing. Raise %s to train on; pass "
                "resume='never', another dirpath or a new run_name to start over.",
                manifest.step,
                epochs_done,
                " and ".join(reached),
                " / ".join(r.split("=")[0] for r in reached),
            )

    def process_train_dataloader(self, dataloader: object) -> object:
        """Give a training dataloader an :class:`ElasticSampler` (continuing a resumed epoch);
        a LitData ``StreamingDataLoader`` keeps its own position, its epochs kept where the
        loop counts them (:mod:`~lightning_elastic.lightning.litdata_loaders`); other
        dataloaders pass through. LitData datasets of every stage's dataloaders are checked
        to read this rank's samples.

        Raises:
            DataShardingError: a LitData dataset was set up for another world size.
        """
        from lightning.pytorch.trainer.states import RunningStage

        from lightning_elastic.lightning import litdata_loaders as litdata
        from lightning_elastic.lightning import litdata_ranks
        from lightning_elastic.lightning.data import make_elastic

        trainer = self.trainer
        stage = trainer.state.stage
        # data-parallel ranks (with tensor parallelism, fewer than the world)
        replicas = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {
            "num_replicas": trainer.world_size,
            "rank": trainer.global_rank,
        }
        rank, world = replicas["rank"], replicas["num_replicas"]
        litdata_ranks.check_ranks(
            dataloader,
            rank=rank,
            replicas=world,
            all_agree=lambda ok: bool(trainer.strategy.reduce_boolean_decision(ok, all=True)),
            hook=f"{getattr(stage, 'dataloader_prefix', None) or 'train'}_dataloader()",
        )
        if stage != RunningStage.TRAINING:
            return dataloader
        litdata.warn_leftover_sigint()
        if litdata_ranks.is_streaming_loader(dataloader):  # keeps its own position: see there
            self.adopt_sampler(None)
            litdata.adopt(
                dataloader,
                trainer,
                world=world,
                states=pending_loader_states(trainer),
                loop=litdata.LoopPosition.of(trainer),
                global_batch_size=self.global_batch_size,
                at_empty_pass=self.restore_rank_state,
            )
            return dataloader
        if litdata_ranks.streaming_datasets(getattr(dataloader, "dataset", None)):
            litdata.warn_not_resumable(dataloader)  # e.g. a torch DataLoader over LitData's
            self.adopt_sampler(None)
            return dataloader
        dataloader, sampler = make_elastic(
            dataloader, num_replicas=world, rank=rank, global_batch_size=self.global_batch_size
        )
        self.adopt_sampler(sampler)
        return dataloader

    def adopt_sampler(self, sampler: FollowsTheLoop | None) -> None:
        """A training dataloader was (re)built: continue the epoch where the checkpoint left it."""
        self.sampler = sampler
        if sampler is not None:
            sampler.follow(self.trainer)
        if sampler is not None and self.pending_position is not None:
            sampler.resume(self.pending_position)
            self.pending_position = None

    def on_train_start(self) -> None:
        """At the start of a resumed fit's training: put back the last logged values
        (``trainer.callback_metrics``: Lightning reset them after the checkpoint was loaded),
        so the hooks before the first resumed batch (``on_train_epoch_start``, every
        callback's ``on_train_batch_start``) read them as an unbroken run does."""
        pending = self.pending_rank_state
        if pending is not None:
            decoded = logged.restore_last(self.trainer, pending.get(logged.RANK_STATE_KEY))
            pending[logged.RANK_STATE_KEY] = decoded  # read once

    def on_train_batch_start(self) -> None:
        """At every training batch's start: note the dataloaders' states (a save taken
        before the next batch holds them); right before the first resumed step, put back this
        rank's RNG, metric states and logged values (after dataloader iterators were created,
        so they cannot shift the streams; at the point of the batch where they were saved)."""
        self.loader_states.record(self.trainer)
        self.restore_rank_state()

    def restore_rank_state(self) -> None:
        """Put back this rank's RNG, metric states and logged values, if a resume left them
        pending (once): at the first resumed batch's start or, when the resumed epoch has no
        batch left (a LitData loader's empty pass), where it would have started."""
        pending = self.pending_rank_state
        if pending is None:
            return
        self.pending_rank_state = None
        states = pending.get("rng")
        if states is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            states = rng.derived_states(seed, self.ensure_coordinator().rank)
        rng.restore(states)
        module = self.trainer.lightning_module
        if pending.get("reset_metrics"):
            reset_metrics(module)
        restore_metric_states(module, pending.get("metrics") or {})
        if logged.restore(self.trainer, pending.get(logged.RANK_STATE_KEY)):
            # what epoch-end plateau steps read is back: Lightning may step them again
            finish_fit_loop_restart(self.trainer)


def _in_training(trainer: Any) -> bool:
    """Whether a save now is one inside training: in a training hook, or in a validation
    that runs inside a training epoch (where Lightning's ``ModelCheckpoint(monitor=...)``
    saves, in ``on_validation_end``; ``trainer.training`` is ``False`` there, and such a
    checkpoint used to hold no data position: its resume replayed the epoch's batches)."""
    return bool(trainer.training) or training_epoch_open(trainer)


def is_our_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is one of ours (``ElasticCheckpointing``: it routes checkpoints
    and dataloaders through the session itself, and reads name-keyed optimizer states)."""
    return hasattr(type(strategy), "_session")


def model_mismatch(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, keys: bool = True
) -> str | None:
    """The first difference between a checkpoint's model ``state_dict`` and the model's, in
    words (a missing or unexpected key, or a shape), or ``None``; ``keys=False`` (a module
    with ``strict_loading=False``) compares only the shapes of the keys both have."""
    if keys:
        for key in current:
            if key not in saved:
                return f"{key!r} is not in the checkpoint"
        for key in saved:
            if key not in current:
                return f"the checkpoint has {key!r}, which this model does not"
    for key, tensor in current.items():
        if key not in saved:
            continue
        old, new = getattr(saved[key], "shape", None), getattr(tensor, "shape", None)
        if old is not None and new is not None and tuple(old) != tuple(new):
            return f"{key!r} has shape {tuple(old)} in the checkpoint, {tuple(new)} in this model"
    return None


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def hparams_difference(saved: Any, current: Any) -> str | None:
    """The first hyperparameter whose value differs between two JSON-safe renderings (see
    :func:`_jsonable`), or ``None``; values that are reprs of objects with a memory address
    differ on every run: the addresses are left out of the comparison."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return None

    def canonical(value: Any) -> str:  # memory addresses anywhere inside are left out
        return _ADDRESS.sub("", json.dumps(value, sort_keys=True, default=repr))

    for key in sorted(set(saved) | set(current), key=str):
        old, new = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if canonical(old) != canonical(new):
            return f"{key}: {old!r} in the checkpoint, {new!r} now"
    return None


def _epochs_done(checkpoint: Mapping[str, Any]) -> int:
    """How many epochs the checkpoint's fit loop completed (not ``current_epoch``, which a stop
    inside an epoch at ``max_steps`` has already advanced)."""
    try:
        progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]
        return int(progress["completed"])
    except (KeyError, TypeError, ValueError):
        return int(checkpoint.get("epoch", 0) or 0)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def topology(world: int) -> dict[str, int]:
    """World size, local world size (``LOCAL_WORLD_SIZE``) and node count for a world of
    ``world`` ranks, as saved in checkpoint metadata."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {
        "world_size": world,
        "local_world_size": local,
        "nodes": max(1, math.ceil(world / local)),
    }


def _jsonable(value: Any) -> Any:
    """A JSON-safe rendering of hyperparameters (unknown objects become their repr)."""
    try:
        from omegaconf import Container, OmegaConf

        if isinstance(value, Container):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):  # in a stable order (set order follows the hash seed)
        return sorted((_jsonable(v) for v in value), key=repr)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)
