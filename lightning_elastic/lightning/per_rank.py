"""Who decides, at another world size, for entries of Lightning's checkpoint that differed
between ranks and were saved per rank (:mod:`lightning_elastic.core.save.replicated`).

At the world size that saved them every rank gets its own value back; nothing here applies.
At another one, each entry's owner decides (:func:`per_rank_rules`):

* the model's ``state_dict``: rank 0's. DDP broadcasts rank 0's buffers at the start of every
  forward (``broadcast_buffers=True``, Lightning's default), so BatchNorm statistics, which
  each rank updates in its own forward, are rank 0's at the next step anyway; parameters are
  identical under DDP;
* ``hyper_parameters`` and ``datamodule_hyper_parameters``: rank 0's (informative only);
* callbacks of Lightning and of lightning_elastic (``ModelCheckpoint``, ``EarlyStopping``,
  ``Timer``, ``DistributedCheckpoint``, ...): rank 0's. They were written for Lightning's own
  checkpoint file, which is rank 0's; their state differs between ranks only through a metric
  logged without ``sync_dist`` or a clock;
* a callback that declares ``per_rank_state_on_resize = "rank0"`` (every rank takes rank 0's
  state) or ``"fresh"`` (its entry is dropped: it keeps its initial state) as a class or
  instance attribute: as declared;
* the stateful training dataloaders' states (``checkpoint["loops"]["fit_loop"]["state_dict"]
  ["combined_loader"]``, e.g. torchdata's ``StatefulDataLoader`` with a shard per rank):
  dropped, with a warning. A position in a rank's own shard means nothing in another
  sharding, and no protocol redistributes it; see :data:`LOADER_REASON` for what it costs;
* anything else (a user callback, the datamodule's state, loop counters, optimizer states):
  :class:`~lightning_elastic.errors.PerRankStateError` with :data:`HINT`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_elastic.core.load.per_rank import RULE_ACTIONS, PerRankRule
from lightning_elastic.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ATTRIBUTE", "HINT", "LOADER_PREFIX", "LOADER_REASON", "per_rank_rules"]

ATTRIBUTE = "per_rank_state_on_resize"
LOADER_PREFIX = ("loops", "fit_loop", "state_dict", "combined_loader")
LOADER_REASON = (
    "The training dataloaders' own states (each rank's position in its own shard, e.g. "
    "torchdata's StatefulDataLoader) cannot be redistributed over another number of ranks: "
    "every rank's loaders restart from their initial state, in the new sharding, while the "
    "loop goes on counting the interrupted epoch's batches. In that epoch, samples already "
    "trained may be trained again and others not at all. Resume with the saved number of "
    "processes for an exact continuation, or use a map-style dataset with ElasticStrategy, "
    "whose sampler deals the epoch's remaining samples over the new ranks."
)
HINT = (
    "Resume with {saved} processes; or make the entry's state_dict() the same on every rank "
    "(e.g. reduce it across ranks before returning it); or, for a callback, set "
    f"{ATTRIBUTE} = 'rank0' (every rank takes rank 0's state) or 'fresh' (the callback "
    "keeps its initial state) on its class."
)
_OWN_CALLBACKS = ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks", "lightning_elastic")
_RANK0 = "rank 0's value, as in Lightning's own checkpoint file"


def per_rank_rules(trainer: pl.Trainer) -> tuple[PerRankRule, ...]:
    """The rules for ``trainer``'s checkpoint entries (see the module docstring).

    Raises:
        ConfigError: a callback declares an unknown ``per_rank_state_on_resize``.
    """
    rules = [
        PerRankRule(("state_dict",), "rank0", _model_reason(trainer)),
        PerRankRule(("hyper_parameters",), "rank0", _RANK0),
        PerRankRule(("datamodule_hyper_parameters",), "rank0", _RANK0),
        PerRankRule(LOADER_PREFIX, "fresh", LOADER_REASON),
    ]
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        action = _declared(callback)
        if action is None and type(callback).__module__.startswith(_OWN_CALLBACKS):
            action = "rank0"
        if action is not None:
            reason = _RANK0 if action == "rank0" else "the callback keeps its initial state"
            rules.append(PerRankRule(("callbacks", callback.state_key), action, reason))
    return tuple(rules)


def _model_reason(trainer: pl.Trainer) -> str:
    if hasattr(type(getattr(trainer, "strategy", None)), "device_mesh"):  # FSDP2 / TP
        return (
            "sharded parameters are resharded; buffers (e.g. BatchNorm statistics), which each "
            "rank keeps for itself under FSDP, become rank 0's on every rank"
        )
    return (
        "DDP broadcasts rank 0's buffers at the next forward (BatchNorm statistics differ "
        "between ranks between two steps); parameters are identical under DDP"
    )


def _declared(callback: Any) -> str | None:
    action = getattr(callback, ATTRIBUTE, None)
    if action is not None and action not in RULE_ACTIONS:
        raise ConfigError(
            f"{type(callback).__name__}.{ATTRIBUTE} must be one of {RULE_ACTIONS} or None, got "
            f"{action!r}"
        )
    return action
