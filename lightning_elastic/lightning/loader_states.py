"""The training dataloaders' states as of the last batch trained, for a save taken later.

Lightning saves the state of every stateful training dataloader (``state_dict()``, e.g.
torchdata's ``StatefulDataLoader``) in its loop state, reading it when the checkpoint is
dumped. ``DistributedCheckpoint`` takes a save decided at the end of batch k at the next quiet
point, the start of batch k+1, by which time the loop has already fetched batch k+1: the
loader's state is one batch ahead, and a resume skipped that batch (seen with a
``StatefulDataLoader``: the resumed run trained batch k+2 first). A dataloader without a
length is one more batch ahead: Lightning's data fetcher takes a batch in advance to know when
the epoch ends.

:class:`LoaderStates` therefore keeps the states read at the start of each batch (after its
fetch: sized loaders have then yielded exactly the batches up to this one), and a save
replaces the live states with the ones of the last batch trained. Cost: one ``state_dict()``
and a deep copy per stateful loader and batch (~60 us for a ``StatefulDataLoader``), nothing
when no training loader keeps a state (our own elastic loaders report an empty one).
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from typing import Any

from lightning_elastic.lightning._compat import prefetched_batches, train_loader_states

__all__ = ["LoaderStates"]

log = logging.getLogger(__name__)


class LoaderStates:
    """The stateful training dataloaders' states at the start of the last few batches."""

    def __init__(self) -> None:
        # (epoch, batches the fetcher holds ahead of the loop, the states) per batch start
        self._history: deque[tuple[int, int, list[dict[str, Any]]]] = deque(maxlen=3)

    def record(self, trainer: Any) -> None:
        """At the start of a training batch (after Lightning fetched it, before it runs)."""
        states = train_loader_states(trainer)
        if not states or not any(states):
            self._history.clear()  # no loader keeps a state: nothing to correct
            return
        self._history.append(
            (trainer.current_epoch, prefetched_batches(trainer), copy.deepcopy(states))
        )

    def after_last_batch(self) -> list[dict[str, Any]] | None:
        """The states as of the end of the last batch that started, or ``None`` when they are
        not known (no stateful loader, or a loader without a length at an epoch's first
        batch: the live state, one batch ahead, is then saved)."""
        if not self._history:
            return None
        epoch, ahead, _ = self._history[-1]
        if ahead >= len(self._history):
            log.debug("training dataloader state of the last batch unknown: saving the live one")
            return None
        then, _, states = self._history[-1 - ahead]
        return states if then == epoch else None

    def apply(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` (Lightning's dict, dumped now) with the dataloaders' states of the
        last batch trained; the containers on the way are copied, not changed."""
        states = self.after_last_batch()
        try:
            fit_loop = checkpoint["loops"]["fit_loop"]
            saved = fit_loop["state_dict"]["combined_loader"]
        except (KeyError, TypeError):
            return checkpoint
        if states is None or len(states) != len(saved):
            return checkpoint
        loop_state = {**fit_loop["state_dict"], "combined_loader": states}
        loops = {**checkpoint["loops"], "fit_loop": {**fit_loop, "state_dict": loop_state}}
        return {**checkpoint, "loops": loops}
