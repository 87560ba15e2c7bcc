"""torchmetrics states across a resume: kept per rank, merged when the world size changes.

At the same world size every rank gets its own accumulators back. At another world size the
saved ranks' accumulators are folded into rank 0 by each state's reduction (``sum``, ``cat``,
``max``, ``min``) and the other ranks start empty, so an epoch-level value (which syncs all
ranks) equals the uninterrupted run's. A metric with another reduction (``mean``, custom
functions, ``None``) cannot be folded exactly: it restarts empty, with a warning naming it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_elastic.lightning._compat import (
    metric_reductions,
    metric_update_count,
    set_metric_update_count,
)

__all__ = ["fold_metric_states", "metric_states", "reset_metrics", "restore_metric_states"]

log = logging.getLogger(__name__)


def _metrics(module: torch.nn.Module) -> dict[str, Any]:
    try:
        from torchmetrics import Metric
    except ImportError:
        return {}
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def metric_states(module: torch.nn.Module) -> dict[str, Any]:
    """Every torchmetrics ``Metric``'s accumulated state, by module name (this rank's)."""
    return {
        name: {
            "state": {k: _detach(v) for k, v in metric.metric_state.items()},
            "update_count": metric_update_count(metric),
        }
        for name, metric in _metrics(module).items()
    }


def restore_metric_states(module: torch.nn.Module, states: Mapping[str, Any]) -> None:
    """Put back the accumulators :func:`metric_states` saved, by module name; metrics without a
    saved state are left as they are."""
    for name, metric in _metrics(module).items():
        if name in states:
            saved = states[name]
            for attr, value in saved["state"].items():
                setattr(metric, attr, _to_device(value, metric.device))
            set_metric_update_count(metric, int(saved["update_count"]))


def reset_metrics(module: torch.nn.Module) -> None:
    """Reset every torchmetrics ``Metric`` in ``module``."""
    for metric in _metrics(module).values():
        metric.reset()


def fold_metric_states(
    module: torch.nn.Module, per_rank: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """All saved ranks' accumulators of each metric folded into one (for one rank to hold)."""
    from torchmetrics.utilities.data import (
        dim_zero_cat,
        dim_zero_max,
        dim_zero_min,
        dim_zero_sum,
    )

    folded: dict[str, Any] = {}
    for name, metric in _metrics(module).items():
        entries = [states[name] for states in per_rank if name in states]
        if not entries:
            continue
        merged: dict[str, Any] = {}
        for attr, reduce in metric_reductions(metric).items():
            values = [entry["state"][attr] for entry in entries]
            if reduce is dim_zero_sum:
                merged[attr] = torch.stack([torch.as_tensor(v) for v in values]).sum(dim=0)
            elif reduce is dim_zero_max:
                merged[attr] = torch.stack([torch.as_tensor(v) for v in values]).amax(dim=0)
            elif reduce is dim_zero_min:
                merged[attr] = torch.stack([torch.as_tensor(v) for v in values]).amin(dim=0)
            elif reduce is dim_zero_cat:
                merged[attr] = _concatenate(values)
            else:
                merged = {}
                message = (
                    f"metric {name!r} ({type(metric).__name__}) reduces {attr!r} with "
                    f"{getattr(reduce, '__name__', reduce)!r}, which cannot be merged across a "
                    "world-size change: it restarts empty at the resume point"
                )
                log.warning(message)
                warnings.warn(message, stacklevel=2)
                break
        if merged:
            count = sum(int(entry["update_count"]) for entry in entries)
            folded[name] = {"state": merged, "update_count": count}
    return folded


def _concatenate(values: Sequence[Any]) -> Any:
    if all(isinstance(v, list) for v in values):
        return [t for v in values for t in v]
    return torch.cat(
        [torch.as_tensor(v).reshape(-1, *torch.as_tensor(v).shape[1:]) for v in values]
    )


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list):
        return [_detach(v) for v in value]
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value
