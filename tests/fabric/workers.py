"""Rank functions for tests/fabric/test_checkpoint_io_fabric.py (module level: they pickle)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_elastic import ElasticCheckpointIO
from lightning_elastic.testing.faults import Fault


def make_state(fabric: Fabric) -> dict[str, Any]:
    """A small model and AdamW, set up by ``fabric``, in Fabric's state dict form."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    return {"model": model, "optimizer": optimizer, "step": 0}


def train_step(fabric: Fabric, state: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(100 * state["step"] + fabric.global_rank)
    x = torch.randn(4, 6, generator=generator)
    loss = state["model"](x).pow(2).mean()
    fabric.backward(loss)
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["step"] += 1


def weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def train_and_die_mid_save(root: str, start: str) -> dict[str, Any]:
    """Every rank: load ``start`` (saved by one process), train under DDP and save
    ``last.ckpt`` every step; rank 0 is SIGKILLed once the second save's shard is written,
    before its manifest (what it expects to be left is in ``expected.pt``)."""
    fault = Fault("closed", "*/last.ckpt/*.distcp", "kill", skip=1, ranks=(0,))
    io = ElasticCheckpointIO(storage_options={"faults": [fault]})
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    state = make_state(fabric)
    fabric.load(start, state)
    out: dict[str, Any] = {"loaded_step": state["step"], "loaded": weights(state)}
    try:
        for i in range(4):
            train_step(fabric, state)
            fabric.save(f"faulty://{root}/last.ckpt", state)
            if i == 0 and fabric.global_rank == 0:
                io.wait()  # committed: the next save of last.ckpt dies before its commit
                expected = {"step": state["step"], "weights": weights(state)}
                torch.save(expected, f"{root}/expected.pt")
            fabric.barrier()
    except RuntimeError as exc:  # rank 1: the peer is gone (gloo says so)
        out["error"] = str(exc)[:200]
    return out
