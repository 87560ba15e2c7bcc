"""How a rank's ``self.log`` capture (see :mod:`~lightning_elastic.lightning.logged`) is
stored in a checkpoint, and read back from untrusted storage.

Version 2 stores the whole capture as ONE JSON document (``{"version": 2, "json": "..."}``):
two entries in the rank's state, whatever the number of logged values. Version 1 stored it as
nested dicts of tensors and plain values, and the checkpoint's tensor format made each leaf an
entry of its own (~30 per ``self.log`` name, each with its metadata and its own record): a
module logging 50 values (``on_step`` and ``on_epoch``) added 1.76 MB and 0.1-0.6 s to every
save of a 222 KB checkpoint (measured on this project's shared 2-core machine); as JSON it
adds 49 KB and ~3 ms, no save time we could tell from the noise. Every value is a tensor
of at most a few elements (``self.log`` takes one-element tensors), written exactly: its dtype,
shape and the Python numbers ``tolist`` gives (floats of every width round-trip; NaN and
infinities as JSON's ``NaN``/``Infinity``).

:func:`decode` reads either version into one in-memory form (version 1's layout, with
tensors) and validates every field: a value of the wrong type is left out (an entry of
``results`` with it is reported by its ``self.log`` name, never a crash).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DECODED_VERSION", "FORMAT_VERSION", "Decoded", "decode", "encode"]

FORMAT_VERSION = 2
DECODED_VERSION = 1  # the in-memory form (and version 1's stored form)
MAX_ELEMENTS = 1024  # per tensor: a logged value has one; a metric's forward output a few
REDUCTIONS = frozenset(
    {"mean", "sum", "max", "min", "builtins.sum", "builtins.max", "builtins.min"}
)
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    )
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# self.log's arguments as result_entry gives them, and the type each must have
_META: dict[str, tuple[type, ...]] = {
    "fx": (str,),
    "name": (str,),
    "prog_bar": (bool,),
    "logger": (bool,),
    "on_step": (bool,),
    "on_epoch": (bool,),
    "enable_graph": (bool,),
    "add_dataloader_idx": (bool,),
    "dataloader_idx": (int, type(None)),
    "metric_attribute": (str, type(None)),
    "reduce_fx": (str,),
    "sync_dist": (bool,),
    "rank_zero_only": (bool,),
    "sync_group": (bool,),
}
_MAPS = ("callback_metrics", "logged_metrics")


class Decoded(dict[str, Any]):
    """A capture as :func:`decode` read it; ``skipped`` names the entries of ``results``
    left out as malformed (by their ``self.log`` name, else their key, else ``"?"``)."""

    skipped: list[str]


def encode(capture: Mapping[str, Any]) -> dict[str, Any]:
    """``capture`` (the in-memory form, CPU tensors) as stored: one JSON document."""
    document = {
        **{name: _tensor_map(capture[name]) for name in _MAPS},
        "progress_bar_metrics": {
            k: v if isinstance(v, (int, float)) else _tensor(v)
            for k, v in capture["progress_bar_metrics"].items()
        },
        "results": [
            {
                **entry,
                "state": _tensor_map(entry["state"]),
                "forward_cache": _tensor(entry["forward_cache"]),
                "computed": _tensor(entry["computed"]),
            }
            for entry in capture["results"]
        ],
    }
    plain = ("first_loop_iter", "current_fx", "distributed", "epoch_open")
    document.update({name: capture[name] for name in plain})
    return {"version": FORMAT_VERSION, "json": json.dumps(document, separators=(",", ":"))}


def decode(saved: Any) -> Decoded | None:
    """The in-memory form of a stored capture (version 1 or 2), every field checked; ``None``
    for something that is not a capture this version reads."""
    if not isinstance(saved, Mapping):
        return None
    version = saved.get("version")
    if version == FORMAT_VERSION:
        try:
            document = json.loads(saved["json"])
        except (KeyError, TypeError, ValueError, RecursionError):
            return None
        read = _tensor_from_json
    elif version == DECODED_VERSION:
        document, read = saved, _tensor_as_is
    else:
        return None
    if not isinstance(document, Mapping):
        return None
    first = document.get("first_loop_iter")
    first = first if isinstance(first, bool) else None
    open_ = document.get("epoch_open")
    out = Decoded(
        version=DECODED_VERSION,
        **{name: _map(document.get(name), read) for name in _MAPS},
        progress_bar_metrics=_map(document.get("progress_bar_metrics"), read, numbers=True),
        first_loop_iter=first,
        current_fx=_str_or_none(document.get("current_fx")),
        distributed=document.get("distributed") is True,
        # version 1 and captures of 2.0 had no epoch_open: inside an epoch's batches then
        epoch_open=open_ if isinstance(open_, bool) else first is not None,
        results=[],
    )
    earlier = document.get("skipped")  # what a fold left out already
    out.skipped = [n for n in earlier if isinstance(n, str)] if isinstance(earlier, list) else []
    results = document.get("results")
    for entry in results if isinstance(results, list) else ():
        checked = _entry(entry, read)
        if checked is None:
            out.skipped.append(label(entry))
        else:
            out["results"].append(checked)
    return out


def label(entry: Any) -> str:
    """How a saved entry is named in a warning: ``self.log``'s name, else its key."""
    if not isinstance(entry, Mapping):
        return "?"
    meta = entry.get("meta")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if isinstance(name, str):
        return name
    key = entry.get("key")
    return key if isinstance(key, str) else "?"


# ----------------------------------------------------------------------------- internals


def _entry(entry: Any, read: Any) -> dict[str, Any] | None:
    """One entry of ``results``, checked; ``None`` if anything in it is malformed."""
    if not isinstance(entry, Mapping):
        return None
    meta = entry.get("meta")
    state = entry.get("state")
    key = entry.get("key")
    count = entry.get("update_count")
    if not (
        isinstance(key, str)
        and isinstance(entry.get("is_tensor"), bool)
        and isinstance(entry.get("has_reset"), bool)
        and isinstance(count, int)
        and not isinstance(count, bool)
        and count >= 0
        and isinstance(meta, Mapping)
        and all(isinstance(meta.get(k, ...), types) for k, types in _META.items())
        and meta["reduce_fx"] in REDUCTIONS
        and isinstance(state, Mapping)
        and all(isinstance(k, str) for k in state)
    ):
        return None
    tensors = {k: read(v) for k, v in state.items()}
    if any(v is None for v in tensors.values()):
        return None
    cached = {name: entry.get(name) for name in ("forward_cache", "computed")}
    if any(v is not None and read(v) is None for v in cached.values()):
        return None
    return {
        "key": key,
        "is_tensor": entry["is_tensor"],
        "meta": {k: meta[k] for k in _META},
        "state": tensors,
        **{name: None if v is None else read(v) for name, v in cached.items()},
        "has_reset": entry["has_reset"],
        "update_count": count,
    }


def _map(values: Any, read: Any, *, numbers: bool = False) -> dict[str, Any]:
    """A mapping of names to tensors (and with ``numbers``, plain numbers); others dropped."""
    if not isinstance(values, Mapping):
        return {}
    out: dict[str, Any] = {}
    for name, value in values.items():
        if not isinstance(name, str):
            continue
        if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
        elif (tensor := read(value)) is not None:
            out[name] = tensor
    return out


def _tensor_map(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: t for k, v in values.items() if (t := _tensor(v)) is not None}


def _tensor(value: Any) -> dict[str, Any] | None:
    """A tensor as JSON (dtype, shape, values); ``None`` for none, or one it cannot hold."""
    if not isinstance(value, torch.Tensor):
        return None
    name = _NAMES.get(value.dtype)
    if name is None:
        return None
    if value.dim() == 0:  # nearly all of them: item() is 3x faster than tolist()
        return {"dtype": name, "shape": [], "values": [value.item()]}
    if value.numel() > MAX_ELEMENTS:
        return None
    return {"dtype": name, "shape": list(value.shape), "values": value.reshape(-1).tolist()}


def _tensor_from_json(value: Any) -> torch.Tensor | None:
    if not isinstance(value, Mapping):
        return None
    dtype = _DTYPES.get(value.get("dtype"))  # type: ignore[arg-type]
    shape = value.get("shape")
    values = value.get("values")
    if (
        dtype is None
        or not isinstance(shape, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        or not isinstance(values, list)
        or len(values) > MAX_ELEMENTS
        or len(values) != math.prod(shape)
        or not all(isinstance(v, (int, float)) for v in values)
    ):
        return None
    try:
        return torch.tensor(values, dtype=dtype).reshape(shape)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def _tensor_as_is(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
