"""``fit/validate/test/predict(ckpt_path="last" | "best")`` with a ``DistributedCheckpoint``.

Lightning turns these strings into paths in ``_CheckpointConnector._parse_ckpt_path``, from
``ModelCheckpoint``'s files, before any callback is set up (so before our engine exists):
with only our callback it would warn "no last checkpoint" and run on the current weights, or
find no ``best_model_path`` after a restart. We wrap that method (once per process, through
:mod:`lightning_elastic.lightning._compat`): when the trainer's checkpoint callback
(``trainer.checkpoint_callback``, the first one) is a ``DistributedCheckpoint``, the string
becomes a :class:`CheckpointAlias`, which the resume hook (:mod:`.resume`) resolves with the
callback's engine on every rank together:

* ``"last"``: the newest valid checkpoint of the callback's directory (what ``resume="auto"``
  picks); none: a warning, and the run starts from the current weights, as Lightning does;
* ``"best"``: the valid checkpoint with the best ``monitor`` value recorded in its manifest
  (``mode``), ranked like ``KeepBestK``; in this process or a fresh one.

A trainer whose ``CheckpointIO`` is ``ElasticCheckpointIO`` gets its own ``"last"`` (see
:mod:`.checkpoint_io_rules`). Every other ``ckpt_path``, and every other trainer, goes through
Lightning's own code unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_elastic.errors import CheckpointNotFoundError, ConfigError
from lightning_elastic.lightning._compat import wrap_ckpt_path_parser

if TYPE_CHECKING:
    from lightning_elastic.lightning.callback import DistributedCheckpoint
    from lightning_elastic.lightning.session import ElasticSession

__all__ = ["ALIASES", "CheckpointAlias", "install_alias_parser", "resolve_alias"]

ALIASES = ("last", "best")


class CheckpointAlias(str):
    """``"last"`` or ``"best"`` (it compares equal to the string) bound to the
    ``DistributedCheckpoint`` that resolves it; what Lightning passes on to ``resume_start``."""

    callback: DistributedCheckpoint
    fn: str  # fit, validate, test, predict: for messages

    def __new__(cls, alias: str, callback: DistributedCheckpoint, fn: str) -> CheckpointAlias:
        """The alias ``alias`` of ``callback``'s checkpoints, asked for by ``Trainer.<fn>``."""
        obj = super().__new__(cls, alias)
        obj.callback = callback
        obj.fn = fn
        return obj


def install_alias_parser() -> None:
    """Make ``ckpt_path="last"/"best"`` refer to a ``DistributedCheckpoint``'s checkpoints
    (process-wide, idempotent; called when ``lightning_elastic.lightning`` is imported)."""
    wrap_ckpt_path_parser(_wrap)


def _wrap(original: Any) -> Any:
    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(ckpt_path, str) and ckpt_path in ALIASES:
            fn = str(getattr(state_fn, "value", state_fn))
            alias = _alias(self.trainer, str(ckpt_path), fn)
            if alias is not None:
                return alias
            if ckpt_path == "last":  # ElasticCheckpointIO: the newest that verifies
                from lightning_elastic.lightning.checkpoint_io_rules import last_checkpoint

                last = last_checkpoint(self.trainer, fn)
                if last is not None:
                    return last
        return original(self, state_fn, ckpt_path, *args, **kw)

    return _parse_ckpt_path


def _alias(trainer: Any, alias: str, fn: str) -> CheckpointAlias | None:
    from lightning_elastic.lightning.callback import DistributedCheckpoint

    callback = trainer.checkpoint_callback
    if not isinstance(callback, DistributedCheckpoint):
        return None
    if alias == "best" and not callback.monitor:
        raise ConfigError(
            f'{fn}(ckpt_path="best") ranks checkpoints by a metric, and DistributedCheckpoint '
            'has no monitor: pass DistributedCheckpoint(monitor="<a metric you self.log>", '
            'mode="min" or "max"), or use ckpt_path="last" or a checkpoint directory'
        )
    return CheckpointAlias(alias, callback, fn)


def resolve_alias(
    alias: CheckpointAlias, session: ElasticSession, *, verify: str
) -> dict[str, Any] | None:
    """Load the checkpoint ``alias`` names for the trainer (every rank together): Lightning's
    checkpoint dict, or ``None`` for ``"last"`` without any valid checkpoint (warned)."""
    callback = alias.callback
    engine = callback.engine
    where = engine.storage.display()
    # chosen (and verified, walking back past corrupt ones) like a resume chooses, then loaded
    # by name: an explicit choice of the user's, not an automatic resume
    if alias == "last":
        info = engine.latest(verify=verify)
        if info is None:
            rank_zero_warn(
                f'{alias.fn}(ckpt_path="last") is set, but {where} holds no valid checkpoint: '
                "no checkpoint will be loaded"
            )
            return None
    else:
        assert callback.monitor is not None  # checked when the alias was made
        info = engine.best(callback.monitor, callback.mode, verify=verify)
        if info is None:
            raise CheckpointNotFoundError(
                f'{alias.fn}(ckpt_path="best"): no valid checkpoint in {where} recorded '
                f"{callback.monitor!r}. A checkpoint records the monitor's value from "
                f"trainer.callback_metrics when it is saved: self.log({callback.monitor!r}, "
                '...) before the save, or pass ckpt_path="last" or a checkpoint directory'
            )
    # verified just now; multi-tier: chosen only, the copies are verified as they are loaded
    again = verify if engine.multi_tier else "none"
    return session.load(engine, name=info.name, verify=again)
