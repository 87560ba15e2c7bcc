"""What ``self.log`` left behind, across a resume: the last values Lightning shows callbacks,
loggers and the progress bar, and the epoch-level accumulators of the epoch in progress.

Lightning keeps them in memory only, and its checkpoint has none of them, so a resumed run
started with ``trainer.callback_metrics`` empty: a ``ReduceLROnPlateau`` stepped between two
validations (``interval="step"`` with a ``frequency`` that is not the validation interval)
found no ``val_loss`` and raised (``strict=True``) or skipped its step (``strict=False``),
and an ``on_epoch=True`` value covered only the batches after the resume.

Saved per rank with every checkpoint (rank-local state, tensors and plain values only) by
:func:`capture`:

* ``trainer.callback_metrics``, ``trainer.logged_metrics`` and
  ``trainer.progress_bar_metrics`` as the logger connector holds them;
* every ``self.log`` of the training hooks (the training loop's result collection): its
  arguments, its accumulators (sum, count, maximum or minimum of the epoch so far), its last
  step value; a logged torchmetrics ``Metric`` by its attribute (its state is saved by
  :mod:`~lightning_elastic.lightning.torchmetrics_state`);
* where the loop stands for ``self.log`` (first batch of an epoch or not, the last hook that
  logged), which decides whether the next ``self.log`` starts the epoch's values afresh.

Put back by :func:`restore` right before the first resumed training batch (the point of a
batch where :class:`~lightning_elastic.DistributedCheckpoint` saves), after which Lightning's
skip of epoch-interval plateau steps in the resumed epoch is lifted (see
:func:`~lightning_elastic.lightning._compat.finish_fit_loop_restart`). A capture taken
outside an epoch's batches (an epoch-end hook, the end of a fit that stopped inside an epoch)
gives back the last values only: Lightning closes and resets that epoch's accumulators there.

At another world size (:func:`fold`), every rank gets rank 0's last values (a value logged
without ``sync_dist`` differs per rank, and no rank of the new world is the old one's), and
each accumulator of all saved ranks is folded into rank 0 by its reduction (sums and counts
added, maxima and minima taken); the other ranks hold the same entries, empty. An epoch value
logged with ``sync_dist=True`` (which reduces over the ranks) is then the uninterrupted
run's (up to the order of floating-point additions); one logged without it is each rank's
own by definition, and a new world redefines it: rank 0's covers the saved ranks' batches
and its own. The last step values are rank 0's.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_elastic.lightning._compat import (
    is_distributed,
    logger_connector_state,
    new_result_metric,
    result_entry,
    set_logger_connector_state,
    training_results,
)

__all__ = ["FORMAT_VERSION", "RANK_STATE_KEY", "capture", "fold", "restore"]

log = logging.getLogger(__name__)

RANK_STATE_KEY = "logged"
FORMAT_VERSION = 1
_FOLD = {"mean": "sum", "sum": "sum", "builtins.sum": "sum", "max": "max", "min": "min"}
_FOLD.update({"builtins.max": "max", "builtins.min": "min"})


def capture(trainer: Any) -> dict[str, Any]:
    """This rank's logged values and accumulators, as CPU copies (see the module docstring)."""
    connector = logger_connector_state(trainer)
    entries = []
    for key, metric in training_results(trainer).items():
        entry = result_entry(metric)
        entries.append(
            {
                "key": str(key),
                "is_tensor": entry["is_tensor"],
                "meta": entry["meta"],
                "state": {k: _copy(v) for k, v in entry["state"].items()},
                "forward_cache": _tensor_or_none(entry["forward_cache"]),
                "computed": _tensor_or_none(entry["computed"]),
                "has_reset": entry["has_reset"],
                "update_count": entry["update_count"],
            }
        )
    return {
        "version": FORMAT_VERSION,
        "callback_metrics": _tensors(connector["callback"]),
        "logged_metrics": _tensors(connector["log"]),
        "progress_bar_metrics": {
            str(k): _copy(v)
            for k, v in connector["pbar"].items()
            if isinstance(v, (torch.Tensor, int, float))
        },
        "first_loop_iter": connector["first_loop_iter"],
        "current_fx": connector["current_fx"],
        "distributed": is_distributed(trainer),
        "results": entries,
    }


def restore(trainer: Any, saved: Any) -> bool:
    """Put back what :func:`capture` (or :func:`fold`) saved; ``False`` (nothing changed)
    for a capture this version does not read. An entry that cannot be rebuilt is left out
    with a warning (it starts empty, as after a resume without this state)."""
    if not isinstance(saved, Mapping) or saved.get("version") != FORMAT_VERSION:
        if saved is not None:
            log.warning("the saved logged metrics have an unknown format: not restored")
        return False
    device = trainer.strategy.root_device
    first = saved.get("first_loop_iter")
    live = logger_connector_state(trainer)
    inside = first is not None
    set_logger_connector_state(
        trainer,
        callback=_to(saved.get("callback_metrics"), device),
        log=_to(saved.get("logged_metrics"), device),
        pbar=_to(saved.get("progress_bar_metrics"), device, scalars=True),
        first_loop_iter=bool(first) if inside else live["first_loop_iter"],
        current_fx=_str_or_none(saved.get("current_fx")) if inside else live["current_fx"],
    )
    if not inside:
        # saved outside an epoch's batches (in an epoch-end hook, at the end of a fit):
        # Lightning has closed, or closes again on resuming, that epoch's values, and resets
        # them; the accumulators of this fit's epoch start as Lightning starts them
        return True
    rebuilt = _rebuild_all(trainer, saved, device)
    results = training_results(trainer)
    others = {k: v for k, v in results.items() if k not in rebuilt}
    results.clear()
    results.update(rebuilt)  # in the saved order: epoch-end syncs go in the same order
    results.update(others)
    return True


def fold(per_rank: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What rank 0 and every other rank of a new world restore, from the captures of all
    saved ranks (saved rank 0's first): see the module docstring."""
    captures = [c for c in per_rank if isinstance(c, Mapping)]
    if not captures:
        raise ValueError("no saved rank has logged metrics")
    base = captures[0]
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for capture_ in captures:
        for entry in capture_.get("results") or ():
            by_key.setdefault(str(entry["key"]), []).append(entry)
    first_rank: list[dict[str, Any]] = []
    other_ranks: list[dict[str, Any]] = []
    for entries in by_key.values():
        entry = entries[0]
        common = {
            "key": entry["key"],
            "is_tensor": entry["is_tensor"],
            "meta": entry["meta"],
            "forward_cache": entry["forward_cache"],
            "computed": None,  # computed again from the folded state
            "has_reset": all(bool(e["has_reset"]) for e in entries),
        }
        first_rank.append(
            {
                **common,
                "state": _folded_state(entries),
                "update_count": sum(int(e["update_count"]) for e in entries),
            }
        )
        other_ranks.append({**common, "state": {}, "update_count": 0})
    return {**base, "results": first_rank}, {**base, "results": other_ranks}


# ----------------------------------------------------------------------------- internals


def _folded_state(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    first = entries[0]
    meta = first["meta"]
    if not first["is_tensor"] or not meta.get("on_epoch"):
        return dict(first["state"])  # a step value only (or a Metric's, folded apart)
    how = _FOLD.get(str(meta.get("reduce_fx")))
    folded: dict[str, Any] = {}
    for attr in first["state"]:
        values = torch.stack([torch.as_tensor(e["state"][attr]) for e in entries])
        if how == "sum":
            folded[attr] = values.sum(dim=0)
        elif how == "max":
            folded[attr] = values.amax(dim=0)
        elif how == "min":
            folded[attr] = values.amin(dim=0)
        else:
            raise ValueError(f"{meta.get('name')!r} has reduction {meta.get('reduce_fx')!r}")
    return folded


def _rebuild_all(trainer: Any, saved: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    distributed = is_distributed(trainer)
    unknown_sync = bool(saved.get("distributed")) != distributed and distributed
    modules: dict[str, Any] | None = None
    rebuilt: dict[str, Any] = {}
    skipped: list[str] = []
    for entry in saved.get("results") or ():
        try:
            meta = entry["meta"]
            if entry["is_tensor"] and (unknown_sync or meta["sync_group"]):
                # self.log would compare the sync arguments, which the checkpoint cannot
                # tell here (a group; a sync_dist given where it did not sync): Lightning
                # raises at the next self.log of a rebuilt entry that differs
                skipped.append(_label(entry))
                continue
            payload = dict(entry)
            payload["state"] = {k: _on(v, device) for k, v in entry["state"].items()}
            payload["forward_cache"] = _on(entry["forward_cache"], device)
            payload["computed"] = _on(entry["computed"], device)
            if not entry["is_tensor"]:
                if modules is None:
                    modules = dict(trainer.lightning_module.named_modules())
                payload["metric"] = modules[meta["metric_attribute"]]
            sync_dist = bool(meta["sync_dist"]) and distributed
            metric = new_result_metric(trainer, payload, sync_dist=sync_dist)
            if entry["is_tensor"]:  # initial states too: an epoch-end sync needs them there
                metric = metric.to(device)
            rebuilt[str(entry["key"])] = metric
        except Exception as exc:  # a malformed entry (storage is not trusted): never a crash
            skipped.append(_label(entry))
            log.debug("logged value not restored: %r", exc)
    if skipped:
        names = ", ".join(repr(name) for name in sorted(set(skipped)))
        message = (
            f"the epoch-level values self.log kept as {names} were not restored (a "
            "sync_dist_group, a trainer that syncs where the saved one did not, a torchmetrics "
            "attribute the module no longer has, or a malformed entry): they cover the "
            "batches after the resume only"
        )
        log.warning(message)
        warnings.warn(message, stacklevel=2)
    return rebuilt


def _label(entry: Any) -> str:
    """How a saved entry is named in a warning: ``self.log``'s name, else its key."""
    if not isinstance(entry, Mapping):
        return "?"
    meta = entry.get("meta")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return str(name if name is not None else entry.get("key", "?"))


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _tensors(values: Mapping[Any, Any]) -> dict[str, torch.Tensor]:
    return {str(k): _copy(v) for k, v in values.items() if isinstance(v, torch.Tensor)}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    return _copy(value) if isinstance(value, torch.Tensor) else None


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _to(values: Any, device: torch.device, *, scalars: bool = False) -> dict[str, Any]:
    """Tensors of a saved mapping on ``device`` (and ``scalars``: numbers as they are);
    anything else is left out."""
    if not isinstance(values, Mapping):
        return {}
    kinds = (torch.Tensor, int, float) if scalars else (torch.Tensor,)
    return {str(k): _on(v, device) for k, v in values.items() if isinstance(v, kinds)}
