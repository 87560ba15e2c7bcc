"""Cheap digests of state entries that are equal in every process that holds equal values.

Used to find out whether an entry of the "replicated" state really is the same on every rank
(:mod:`lightning_elastic.core.save.replicated`). A digest must therefore not depend on
anything that differs between processes holding equal values:

* objects are encoded canonically, not pickled: mapping items and set elements are sorted by
  their encoding (insertion order and string-hash randomization do not matter), every NaN is
  one NaN, ``1`` and ``1.0`` and ``True`` differ (they are different values to restore);
* tensors: dtype, shape and content, never the device index (``cuda:0`` and ``cuda:1``
  hold replicas). Tensors of up to :data:`FULL_ELEMENTS` elements are hashed whole; larger
  ones by :data:`SAMPLES` elements spread evenly over them, gathered on their device and
  copied to the host in one transfer per device. A DDP replica is identical by construction;
  what differs per rank in practice (a counter, a generator state, a BatchNorm statistic, a
  per-rank buffer) is small or differs everywhere;
* everything else is pickled. A pickle can differ between processes holding equal values (an
  object with a set of strings, a memory address): such an entry then looks per-rank and is
  stored per rank, which is safe, never wrong.

A digest is a non-negative 63-bit integer (it travels in an ``int64`` all-reduce).
Measured here (one CPU thread, ``benchmarks/bench_replicas.py``): 1.9 ms for a Lightning
checkpoint of 414 entries and 151 MB in 198 tensors (12 Linear(1024)+LayerNorm blocks with
Adam): 0.4 ms for the 36 sampled tensors, 0.9 ms for the 162 small ones hashed whole.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import pickle
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from lightning_elastic.core._compat import flatten_dense

__all__ = [
    "BATCH_BYTES",
    "FULL_ELEMENTS",
    "MASK",
    "SAMPLES",
    "encode",
    "plain_small",
    "tensor_digests",
    "tensor_head",
    "value_digest",
]

MASK = (1 << 63) - 1
FULL_ELEMENTS = 1 << 16  # tensors up to this many elements are hashed whole
SAMPLES = 256  # elements sampled from a larger tensor
_MAX_DEPTH = 64  # deeper (or cyclic) objects are pickled instead


def value_digest(value: Any) -> int:
    """The digest of a non-tensor value (a tensor nested inside it is hashed whole)."""
    return xxhash.xxh3_64_intdigest(encode(value)) & MASK


def unique_digest() -> int:
    """A digest no other process produces: for a value that cannot be encoded, which is then
    treated as different on every rank (stored per rank, the safe side)."""
    return int.from_bytes(os.urandom(8), "little") & MASK


def encode(value: Any, depth: int = 0) -> bytes:
    """The canonical encoding of ``value`` (see the module docstring), type-tagged so that
    values of different types never share an encoding."""
    if value is None:
        return b"N"
    kind = type(value)
    if kind is bool:
        return b"T" if value else b"F"
    if kind is int:
        return b"I%d;" % value
    if kind is float:
        return b"Fnan" if math.isnan(value) else b"F" + struct.pack("<d", value)
    if kind is str:
        data: bytes = value.encode("utf-8", "surrogatepass")
        return b"S%d:" % len(data) + data
    if depth > _MAX_DEPTH:
        return _pickled(value)
    if isinstance(value, torch.Tensor):
        return b"t" + struct.pack("<Q", tensor_digests([value])[0])
    if isinstance(value, Mapping):
        items = sorted(encode(k, depth + 1) + encode(v, depth + 1) for k, v in value.items())
        return b"M%d:" % len(items) + b"".join(items) + _tag(value, dict)
    if isinstance(value, (list, tuple)):
        parts = [encode(v, depth + 1) for v in value]
        return (b"L" if isinstance(value, list) else b"U") + b"%d:" % len(parts) + b"".join(parts)
    if isinstance(value, (set, frozenset)):
        parts = sorted(encode(v, depth + 1) for v in value)
        return b"E%d:" % len(parts) + b"".join(parts)
    return _other(value, depth)


def _other(value: Any, depth: int) -> bytes:
    if isinstance(value, enum.Enum):
        return b"e" + _qualname(type(value)) + encode(value.value, depth + 1)
    for base in (int, float, str):  # subclasses (numpy.float64, a str enum mixin, ...)
        if isinstance(value, base):
            return _qualname(type(value)) + encode(base(value), depth + 1)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return b"B%d:" % len(data) + data
    if isinstance(value, complex):
        return b"C" + encode(value.real) + encode(value.imag)
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return b"d" + str(value).encode()
    if isinstance(value, torch.Generator):
        return b"G" + encode(value.get_state(), depth + 1)
    numpy = sys.modules.get("numpy")  # no numpy value can exist unless numpy was imported
    if numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic)):
        array = numpy.asarray(value)
        if array.dtype.hasobject:
            return _pickled(value)
        raw: bytes = numpy.ascontiguousarray(array).tobytes()
        kind: str = array.dtype.str
        return b"A" + kind.encode() + str(array.shape).encode() + b":" + raw
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        return b"D" + _qualname(type(value)) + encode(fields, depth + 1)
    return _pickled(value)


def _tag(value: Any, base: type) -> bytes:
    return b"" if type(value) is base else _qualname(type(value))


def _qualname(kind: type) -> bytes:
    return f"<{kind.__module__}.{kind.__qualname__}>".encode()


def _pickled(value: Any) -> bytes:
    try:
        return b"P" + pickle.dumps(value, protocol=4)
    except Exception:  # not picklable: DCP will say so; here it is "different everywhere"
        return b"X" + struct.pack("<Q", unique_digest())


# ----------------------------------------------------------------------------- tensors


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The digests of ``tensors`` (dtype, shape and content or samples of it), with one
    device-to-host copy per device for all of them.

    Small plain host tensors (the many-tensor case: 20,000 of 4 KB) skip the per-tensor torch
    calls: they are flattened together, per dtype, in batches of at most
    :data:`BATCH_BYTES` (one C++ call each) and hashed from slices of that buffer. The
    bytes hashed are the same on either path, so a digest does not depend on which was taken."""
    heads: list[bytes] = []
    pieces: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    failed: set[int] = set()
    bodies: dict[int, memoryview] = {}
    done: dict[int, int] = {}  # digests of the batched small tensors
    small: dict[torch.dtype, _Batch] = {}
    for i, tensor in enumerate(tensors):
        head = tensor_head(tensor.dtype, tensor.shape)
        heads.append(head)
        if plain_small(tensor):
            batch = small.get(tensor.dtype)
            if batch is None:
                batch = small[tensor.dtype] = _Batch()
            batch.add(i, head, tensor, done)
            continue
        try:
            piece = _content(tensor)
        except Exception:  # sparse, quantized, ...: different everywhere (stored per rank)
            failed.add(i)
            continue
        if piece is not None:
            pieces.setdefault(piece.device, []).append((i, piece))
    for batch in small.values():
        batch.flush(done)
    for device, items in pieces.items():
        if device.type != "cpu":  # one transfer per device
            host = torch.cat([piece for _, piece in items]).cpu().numpy()
            offset = 0
            for i, piece in items:
                bodies[i] = host[offset : offset + piece.numel()].data
                offset += piece.numel()
            continue
        for i, piece in items:
            bodies[i] = piece.numpy().data
    out = []
    for i, head in enumerate(heads):
        if i in failed:
            out.append(unique_digest())
            continue
        if i in done:
            out.append(done[i])
            continue
        hasher = xxhash.xxh3_64(head)
        body = bodies.get(i)
        if body is not None:
            hasher.update(body)
        out.append(hasher.intdigest() & MASK)
    return out


BATCH_BYTES = 4 << 20


@functools.lru_cache(maxsize=4096)
def tensor_head(dtype: torch.dtype, shape: torch.Size) -> bytes:
    """What a tensor's digest says of its dtype and shape."""
    return f"{dtype}|{tuple(shape)}|".encode()


def plain_small(t: torch.Tensor) -> bool:
    """A plain, dense, contiguous host tensor hashed whole (see :func:`_content`): its bytes
    are the same flattened with others of its dtype."""
    return (
        type(t) is torch.Tensor
        and t.layout is torch.strided
        and not t.is_quantized
        and t.device.type == "cpu"
        and 0 < t.numel() <= FULL_ELEMENTS
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


class _Batch:
    """Small host tensors of one dtype, flattened together when they reach BATCH_BYTES and
    hashed at once (only the digests outlive the batch: one batch of memory at a time)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, bytes, torch.Tensor]] = []
        self.size = 0

    def add(self, i: int, head: bytes, tensor: torch.Tensor, done: dict[int, int]) -> None:
        self.items.append((i, head, tensor))
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= BATCH_BYTES:
            self.flush(done)

    def flush(self, done: dict[int, int]) -> None:
        if not self.items:
            return
        with torch.no_grad():
            flat = flatten_dense([t for _, _, t in self.items])
        host = memoryview(flat.view(torch.uint8).numpy())
        offset = 0
        for i, head, tensor in self.items:
            n = tensor.numel() * tensor.element_size()
            hasher = xxhash.xxh3_64(head)
            hasher.update(host[offset : offset + n])
            done[i] = hasher.intdigest() & MASK
            offset += n
        self.items, self.size = [], 0


@functools.lru_cache(maxsize=512)
def _positions(n: int, device: torch.device) -> torch.Tensor:
    """:data:`SAMPLES` positions spread evenly over ``n`` elements, first and last included
    (cached: a model's tensors come in few sizes, and building them was half the cost)."""
    return torch.linspace(0, n - 1, SAMPLES, dtype=torch.float64).round().long().to(device)


def _content(tensor: torch.Tensor) -> torch.Tensor | None:
    """The bytes to hash (a 1-D uint8 tensor on the tensor's device), ``None`` when there are
    none (an empty or a meta tensor)."""
    if tensor.is_quantized:  # its int_repr hides the scale: different everywhere instead
        raise TypeError("quantized tensors are not digested")
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    n = t.numel()
    if n <= FULL_ELEMENTS:
        flat = t.reshape(-1)
    elif t.is_contiguous():
        flat = t.view(-1)[_positions(n, t.device)]
    else:  # index the logical positions without copying the whole tensor
        at = _positions(n, torch.device("cpu"))
        flat = t[tuple(ix.to(t.device) for ix in torch.unravel_index(at, t.shape))]
    flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)
