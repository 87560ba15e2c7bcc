"""What ``self.log`` left behind, across a resume: the last values Lightning shows callbacks,
loggers and the progress bar, and the epoch-level accumulators of the epoch in progress.

Lightning keeps them in memory only, and its checkpoint has none of them, so a resumed run
started with ``trainer.callback_metrics`` empty: a ``ReduceLROnPlateau`` stepped between two
validations (``interval="step"`` with a ``frequency`` that is not the validation interval)
found no ``val_loss`` and raised (``strict=True``) or skipped its step (``strict=False``),
and an ``on_epoch=True`` value covered only the batches after the resume.

Saved per rank with every checkpoint by :func:`capture`, as one JSON document (see
:mod:`~lightning_elastic.lightning.logged_format`: tensors and plain values only):

* ``trainer.callback_metrics``, ``trainer.logged_metrics`` and
  ``trainer.progress_bar_metrics`` as the logger connector holds them;
* every ``self.log`` of the training hooks (the training loop's result collection): its
  arguments, its accumulators (sum, count, maximum or minimum of the epoch so far), its last
  step value; a logged torchmetrics ``Metric`` by its attribute (its state is saved by
  :mod:`~lightning_elastic.lightning.torchmetrics_state`);
* where the loop stands for ``self.log`` (the last hook that logged, whether the save was
  taken at a batch's start and at the epoch's first) and whether the epoch's accumulators
  were live: from its start to its end, validations inside it included (where Lightning's
  ``ModelCheckpoint(monitor=...)`` saves through ``ElasticStrategy``).

Put back in two steps. :func:`restore_last`, when a resumed fit's training starts: the last
values, so that ``on_train_epoch_start`` and every callback's ``on_train_batch_start`` read
them (Lightning resets them after loading a checkpoint). :func:`restore`, right before the
first resumed training batch (the point of a batch where
:class:`~lightning_elastic.DistributedCheckpoint` saves): the accumulators, where the epoch
they belong to goes on; after that, Lightning's skip of epoch-interval plateau steps in the
resumed epoch is lifted (see :func:`~lightning_elastic.lightning._compat.finish_fit_loop_restart`).
A capture taken after an epoch's end (an epoch-end hook, the end of a fit that stopped inside
an epoch) gives back the last values only: Lightning computes, logs and resets that epoch's
accumulators there. A restored entry whose ``self.log`` is called with other arguments after
the resume (the code was edited) is dropped with a warning and logged afresh, where Lightning
would raise at every restart.

At another world size (:func:`fold`), every rank gets rank 0's last values (a value logged
without ``sync_dist`` differs per rank, and no rank of the new world is the old one's), and
each accumulator of all saved ranks is folded into rank 0 by its reduction (sums and counts
added, maxima and minima taken); the other ranks hold the same entries, empty, of the same
dtypes (they sync together at the epoch's end), and hide those that do not sync until they
log them again. A mean's count becomes a float: Lightning syncs it with op ``"mean"``, an
integer division for an integer count, exact only for counts spread evenly over the ranks.
An epoch value logged with ``sync_dist=True`` (which reduces over the ranks) is then the
uninterrupted run's (up to the order of floating-point additions); one logged without it is
each rank's own by definition, and a new world redefines it: rank 0's covers the saved
ranks' batches and its own. The last step values are rank 0's.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_elastic.lightning._compat import (
    first_batch_of_epoch,
    forgive_changed_log_arguments,
    is_distributed,
    logger_connector_state,
    new_result_metric,
    result_entry,
    set_logger_connector_state,
    training_epoch_open,
    training_results,
)
from lightning_elastic.lightning.logged_format import (
    FORMAT_VERSION,
    REDUCTIONS,
    Decoded,
    decode,
    encode,
)

__all__ = ["FORMAT_VERSION", "RANK_STATE_KEY", "capture", "fold", "restore", "restore_last"]

log = logging.getLogger(__name__)

RANK_STATE_KEY = "logged"
_FOLD = {"mean": "sum", "sum": "sum", "builtins.sum": "sum", "max": "max", "min": "min"}
_FOLD.update({"builtins.max": "max", "builtins.min": "min"})
assert set(_FOLD) == REDUCTIONS


def capture(trainer: Any) -> dict[str, Any]:
    """This rank's logged values and accumulators, as stored (see the module docstring and
    :mod:`~lightning_elastic.lightning.logged_format`: the live tensors are read into
    Python numbers there, one ``item()`` each, ~8 ms for 50 values logged per step)."""
    connector = logger_connector_state(trainer)
    entries = []
    for key, metric in training_results(trainer).items():
        entry = result_entry(metric)
        entries.append(
            {
                "key": str(key),
                "is_tensor": entry["is_tensor"],
                "meta": entry["meta"],
                "state": entry["state"],
                "forward_cache": _tensor_or_none(entry["forward_cache"]),
                "computed": _tensor_or_none(entry["computed"]),
                "has_reset": entry["has_reset"],
                "update_count": entry["update_count"],
            }
        )
    return encode(
        {
            "callback_metrics": _tensors(connector["callback"]),
            "logged_metrics": _tensors(connector["log"]),
            "progress_bar_metrics": {
                str(k): v
                for k, v in connector["pbar"].items()
                if isinstance(v, (torch.Tensor, int, float))
            },
            "first_loop_iter": connector["first_loop_iter"],
            "current_fx": connector["current_fx"],
            "distributed": is_distributed(trainer),
            "epoch_open": training_epoch_open(trainer),
            "results": entries,
        }
    )


def restore_last(trainer: Any, saved: Any) -> Decoded | None:
    """Put back the last values only (``callback_metrics``, ``logged_metrics``,
    ``progress_bar_metrics``; what was logged since wins), as early in a resumed fit as
    hooks read them; returns the decoded capture (for :func:`restore`), ``None`` (nothing
    changed) for a capture this version does not read."""
    decoded = saved if isinstance(saved, Decoded) else decode(saved)
    if decoded is None:
        if saved is not None:
            log.warning("the saved logged metrics have an unknown format: not restored")
        return None
    device = trainer.strategy.root_device
    live = logger_connector_state(trainer)
    set_logger_connector_state(
        trainer,
        callback={**_to(decoded["callback_metrics"], device), **live["callback"]},
        log={**_to(decoded["logged_metrics"], device), **live["log"]},
        pbar={**_to(decoded["progress_bar_metrics"], device), **live["pbar"]},
        first_loop_iter=live["first_loop_iter"],
        current_fx=live["current_fx"],
    )
    return decoded


def restore(trainer: Any, saved: Any) -> bool:
    """Put back what :func:`capture` (or :func:`fold`) saved, right before the first resumed
    training batch runs; ``False`` (nothing changed) for a capture this version does not
    read. An entry that cannot be rebuilt is left out with a warning (it starts empty, as
    after a resume without this state)."""
    decoded = restore_last(trainer, saved)
    if decoded is None:
        return False
    first = first_batch_of_epoch(trainer)
    # the accumulators go on where the epoch the capture saw goes on: a capture at a batch's
    # start (ours) is at the resumed batch, first or not; one from inside an epoch but
    # between batches (a save in a validation, or in on_train_batch_end) precedes the next
    # batch, unless Lightning has closed that epoch before the resumed batch (it does after a
    # save at its last batch)
    if not decoded["epoch_open"] or (first and decoded["first_loop_iter"] is not True):
        _warn_not_restored(decoded.skipped)
        return True
    live = logger_connector_state(trainer)
    set_logger_connector_state(
        trainer,
        callback=live["callback"],
        log=live["log"],
        pbar=live["pbar"],
        first_loop_iter=first,  # as Lightning's on_batch_start has it in an unbroken run
        current_fx=decoded["current_fx"],
    )
    rebuilt, skipped = _rebuild_all(trainer, decoded, trainer.strategy.root_device)
    _warn_not_restored([*decoded.skipped, *skipped])
    results = training_results(trainer)
    others = {k: v for k, v in results.items() if k not in rebuilt}
    results.clear()
    results.update(rebuilt)  # in the saved order: epoch-end syncs go in the same order
    results.update(others)
    forgive_changed_log_arguments(trainer, set(rebuilt), _replaced)
    return True


def fold(per_rank: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What rank 0 and every other rank of a new world restore, from the captures of all
    saved ranks (saved rank 0's first): see the module docstring. A malformed capture or
    entry is left out (an entry by its name, in a warning at the restore)."""
    captures = [c for c in (decode(saved) for saved in per_rank) if c is not None]
    if not captures:
        raise ValueError("no saved rank has logged metrics this version reads")
    base = captures[0]
    skipped = [name for c in captures for name in c.skipped]
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for capture_ in captures:
        for entry in capture_["results"]:
            by_key.setdefault(entry["key"], []).append(entry)
    first_rank: list[dict[str, Any]] = []
    other_ranks: list[dict[str, Any]] = []
    for entries in by_key.values():
        entry = entries[0]
        try:
            state = _folded_state(entries)
        except (RuntimeError, TypeError, ValueError) as exc:  # e.g. shapes that differ
            log.debug("logged value %r not folded: %r", entry["meta"]["name"], exc)
            skipped.append(entry["meta"]["name"])
            continue
        common = {
            "key": entry["key"],
            "is_tensor": entry["is_tensor"],
            "meta": entry["meta"],
            "forward_cache": entry["forward_cache"],
            "computed": None,  # computed again from the folded state
        }
        has_reset = all(e["has_reset"] for e in entries)
        first_rank.append(
            {
                **common,
                "state": state,
                "has_reset": has_reset,
                "update_count": sum(e["update_count"] for e in entries),
            }
        )
        # an entry that syncs is computed by every rank together at the epoch's end, so it
        # must be there on each (empty); one that does not sync would show an epoch value of
        # nothing (NaN, infinity) on a rank that never logs it again: hidden until it does
        meta = entry["meta"]
        syncs = not entry["is_tensor"] or (meta["sync_dist"] and not meta["rank_zero_only"])
        other_ranks.append(
            {
                **common,
                "state": _empty_like(state, meta),
                "has_reset": has_reset or not syncs,
                "update_count": 0,
            }
        )
    rank0 = {**base, "results": first_rank, "skipped": skipped}
    others = {**base, "results": other_ranks, "skipped": skipped}
    return rank0, others


# ----------------------------------------------------------------------------- internals


def _replaced(name: str) -> None:
    message = (
        f"self.log({name!r}, ...) is called with other arguments than before the resume: its "
        "saved epoch-level values were dropped; they cover the batches after the resume only"
    )
    log.warning(message)
    warnings.warn(message, stacklevel=2)


def _folded_state(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    first = entries[0]
    meta = first["meta"]
    if not first["is_tensor"] or not meta["on_epoch"]:
        return dict(first["state"])  # a step value only (or a Metric's, folded apart)
    how = _FOLD[meta["reduce_fx"]]
    folded: dict[str, Any] = {}
    for attr in first["state"]:
        values = torch.stack([e["state"][attr] for e in entries])
        if how == "sum":
            folded[attr] = values.sum(dim=0)
        elif how == "max":
            folded[attr] = values.amax(dim=0)
        else:
            folded[attr] = values.amin(dim=0)
    if "cumulated_batch_size" in folded:
        # a mean syncs its sum and its count with op "mean" (Lightning's _ResultMetric.compute):
        # the sum over the ranks divided by the world size, an integer division for an
        # integer count (_sync_ddp). Equal counts on every rank make it exact; after a fold
        # rank 0 holds the saved ranks' counts, and 64 samples over 3 ranks gave 32.0 for a
        # mean of 31.5. As a float the count divides exactly
        folded["cumulated_batch_size"] = folded["cumulated_batch_size"].double()
    return folded


def _empty_like(state: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's accumulators with nothing in them, of the dtypes of the folded ones (every
    rank syncs them together: same dtypes); ``{}`` (Lightning's initial ones) if none."""
    fill = {"max": -math.inf, "min": math.inf}.get(_FOLD[meta["reduce_fx"]], 0.0)
    return {
        attr: torch.full_like(value, fill if attr == "value" else 0)
        for attr, value in state.items()
        if isinstance(value, torch.Tensor) and meta["on_epoch"]
    }


def _rebuild_all(
    trainer: Any, saved: Mapping[str, Any], device: torch.device
) -> tuple[dict[str, Any], list[str]]:
    """The saved entries as Lightning's, and the names of those left out."""
    distributed = is_distributed(trainer)
    unknown_sync = bool(saved["distributed"]) != distributed and distributed
    modules: dict[str, Any] | None = None
    rebuilt: dict[str, Any] = {}
    skipped: list[str] = []
    for entry in saved["results"]:
        meta = entry["meta"]
        if entry["is_tensor"] and (unknown_sync or meta["sync_group"]):
            # self.log would compare the sync arguments, which the checkpoint cannot tell
            # here (a group; a sync_dist given where it did not sync)
            skipped.append(meta["name"])
            continue
        try:
            payload = dict(entry)
            payload["state"] = {k: v.to(device) for k, v in entry["state"].items()}
            payload["forward_cache"] = _on(entry["forward_cache"], device)
            payload["computed"] = _on(entry["computed"], device)
            if not entry["is_tensor"]:
                if modules is None:
                    modules = _metric_modules(trainer.lightning_module)
                payload["metric"] = modules[meta["metric_attribute"]]
            sync_dist = meta["sync_dist"] and distributed
            metric = new_result_metric(trainer, payload, sync_dist=sync_dist)
            if entry["is_tensor"]:  # initial states too: an epoch-end sync needs them there
                metric = metric.to(device)
            rebuilt[entry["key"]] = metric
        except Exception as exc:  # a value Lightning refuses (storage is not trusted)
            skipped.append(meta["name"])
            log.debug("logged value not restored: %r", exc)
    return rebuilt, skipped


def _warn_not_restored(names: Sequence[str]) -> None:
    if not names:
        return
    listed = ", ".join(repr(name) for name in sorted(set(names)))
    message = (
        f"the epoch-level values self.log kept as {listed} were not restored (a "
        "sync_dist_group, a trainer that syncs where the saved one did not, a torchmetrics "
        "attribute the module no longer has, or a malformed entry): they cover the "
        "batches after the resume only"
    )
    log.warning(message)
    warnings.warn(message, stacklevel=3)


def _metric_modules(module: Any) -> dict[str, Any]:
    """The module's torchmetrics ``Metric`` attributes by name (what ``self.log`` names a
    logged ``Metric`` by); anything else under such a name is not one."""
    from torchmetrics import Metric

    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def _tensors(values: Mapping[Any, Any]) -> dict[str, torch.Tensor]:
    return {str(k): v for k, v in values.items() if isinstance(v, torch.Tensor)}


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _to(values: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A decoded mapping with its tensors on ``device`` (numbers as they are)."""
    return {k: _on(v, device) for k, v in values.items()}
