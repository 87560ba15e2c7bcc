"""Random number generator states of one process: Python, NumPy, torch CPU and CUDA.

Saved per rank (each rank has its own streams) and restored on the same rank after a
resume. A rank that did not exist when the checkpoint was written gets streams derived
deterministically from the run seed and its rank (:func:`derived_states`).
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture", "derived_states", "restore"]


def capture() -> dict[str, Any]:
    """Every generator's state, in a form the checkpoint can hold."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: dict[str, Any]) -> None:
    """Put back what :func:`capture` returned (missing generators are left as they are)."""
    if "python" in states:
        value = states["python"]
        # round-trips through the checkpoint may turn the inner tuple into a list
        random.setstate((value[0], tuple(value[1]), value[2]))
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = list(states["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def derived_states(seed: int, rank: int) -> dict[str, Any]:
    """Deterministic fresh streams for ``rank`` (for ranks new after a world-size change)."""
    mixed = (seed * 1_000_003 + rank * 7919 + 17) % (2**63)
    gen = random.Random(mixed)
    torch_gen = torch.Generator().manual_seed(mixed)
    states: dict[str, Any] = {"python": gen.getstate(), "torch": torch_gen.get_state()}
    try:
        import numpy as np

        states["numpy"] = np.random.RandomState(mixed % (2**32)).get_state()
    except ImportError:
        pass
    return states
