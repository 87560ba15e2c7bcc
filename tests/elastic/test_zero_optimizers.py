"""ZeRO-1 (``shard_optimizer_state=True``) with every common torch optimizer and a user's own.

The sharded optimizer is rebuilt from the optimizer's class; ``optimizer.defaults`` is not its
constructor's signature (AdamW's holds ``decoupled_weight_decay``, which ``AdamW.__init__``
refuses). The matrix: SGD (momentum, nesterov), Adam (amsgrad), AdamW, Adagrad, RMSprop
(centered, momentum), a user's ``Optimizer`` with ``**kwargs`` and a user's AdamW subclass that
forwards ``**kwargs``; each with two parameter groups and a step-interval StepLR, saved after 3
steps on 2 ranks and reloaded on 1, 2 and 3.

Cost: one 2-rank run trains every kind (module fixture), then one run per reload world;
about 25 s in all on 2 cores.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning import zero
from lightning_elastic.testing.spawn import run_distributed
from tests.elastic import zero_workers as zw

KINDS = list(zw.OPTIMIZERS)
SAVED_WORLD = 2


class NeedsWarmup(torch.optim.Optimizer):
    """An extra required argument kept outside the defaults."""

    def __init__(self, params: Any, lr: float = 0.1, *, warmup: int) -> None:
        super().__init__(params, {"lr": lr})
        self.warmup = warmup


class KeepsClip(torch.optim.SGD):
    """An extra optional argument kept as an attribute, outside the defaults."""

    def __init__(self, params: Any, lr: float = 0.1, clip: float = 1.0) -> None:
        super().__init__(params, lr=lr)
        self.clip = clip


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


# ------------------------------------------------------------------ one process


def test_constructor_arguments_leave_out_defaults_the_constructor_refuses() -> None:
    adamw = torch.optim.AdamW(_params(), lr=0.3, weight_decay=0.2)
    assert "decoupled_weight_decay" in adamw.defaults  # the cause of the original crash
    kwargs = zero.constructor_arguments(adamw)
    assert "decoupled_weight_decay" not in kwargs
    assert kwargs == {k: v for k, v in adamw.defaults.items() if k != "decoupled_weight_decay"}
    forwarding = zw.ForwardingAdamW(_params(), lr=0.3)  # **kwargs followed up to AdamW
    assert zero.constructor_arguments(forwarding) == {**kwargs, "weight_decay": 0.01}
    for optimizer in (torch.optim.SGD(_params(), momentum=0.9), torch.optim.Adagrad(_params())):
        assert zero.constructor_arguments(optimizer) == optimizer.defaults
    # **kwargs that reach Optimizer's defaults: every key is accepted
    custom = zw.SignMomentum(_params(), beta=0.7, scale=0.5)
    assert zero.constructor_arguments(custom) == {"lr": 1e-3, "beta": 0.7, "scale": 0.5}


def test_an_init_argument_the_defaults_lack_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"NeedsWarmup.*'warmup' is required"):
        zero.shard(NeedsWarmup(_params(), warmup=3))
    with pytest.raises(ConfigError, match=r"KeepsClip.*'clip' was given 5\.0"):
        zero.shard(KeepsClip(_params(), clip=5.0))
    # left at its default, it is rebuilt with what its own __init__ accepts
    assert zero.constructor_arguments(KeepsClip(_params())) == {"lr": 0.1}


# ------------------------------------------------------------------ one rank


@pytest.mark.timeout(60)
def test_every_kind_shards_keeping_each_groups_hyperparameters() -> None:
    (result,) = run_distributed(zw.shard_kinds, 1, timeout=50)
    for kind in KINDS:
        got = result[kind]
        assert got["local_class"] == type(zw.OPTIMIZERS[kind](zw.ZeroModule(kind))).__name__
        assert got["groups"] == got["original"], kind  # every key, every value, both groups
        assert got["local_groups"] == got["original"], kind  # one rank owns everything
    assert "decoupled_weight_decay" in result["adamw"]["groups"][0]
    assert [g["lr"] for g in result["sgd"]["groups"]] == list(zw.LR)
    error = result["error"]  # a constructor that refuses what its defaults hold
    assert "RejectsExtras" in error and "'decay'" in error, error


# ------------------------------------------------------------------ N -> M reloads


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every kind trained uninterrupted to END on 2 ranks, checkpointed at SAVE_AT."""
    root = tmp_path_factory.mktemp("zero-saved")
    return root, run_distributed(zw.fit_all, SAVED_WORLD, str(root), KINDS, timeout=100)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda m: f"2to{m}")
def reloaded(
    request: pytest.FixtureRequest,
    saved: tuple[Path, list[dict[str, Any]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[int, list[dict[str, Any]]]:
    """Every kind resumed from its SAVE_AT checkpoint on ``request.param`` ranks, to END."""
    root = tmp_path_factory.mktemp(f"zero-reloaded-{request.param}")
    source, _ = saved
    for kind in KINDS:
        shutil.copytree(source / kind, root / kind)
    return request.param, run_distributed(zw.fit_all, request.param, str(root), KINDS, timeout=100)


def _union(results: list[dict[str, Any]], kind: str, when: str) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for r in results:
        part = r[kind][when]["state"]
        assert not set(part) & set(merged), f"{kind}: partitions overlap"
        merged.update(part)
    return merged


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_state_reloads_bitwise_at_any_world_size(
    saved: tuple[Path, list[dict[str, Any]]],
    reloaded: tuple[int, list[dict[str, Any]]],
    kind: str,
) -> None:
    _, before = saved
    world, after = reloaded
    assert all(r[kind]["resumed_from"].endswith(f"step_{zw.SAVE_AT:09d}") for r in after)
    assert all(r[kind]["global_step"] == zw.END for r in after)
    # every parameter's state: the same keys, dtypes and bits, whoever owns it now
    reference, restored = _union(before, kind, "at"), _union(after, kind, "start")
    assert set(restored) == set(reference) == {n for n in before[0][kind]["final"]}
    for name, states in reference.items():
        assert set(restored[name]) == set(states), (name, sorted(restored[name]))
        for key, value in states.items():
            assert _same_value(restored[name][key], value), (name, key)
    # hyperparameters: every group key, on every rank, in the wrapper and in the partition
    groups = before[0][kind]["at"]["groups"]
    for r in after:
        start = r[kind]["start"]
        assert start["groups"] == groups
        assert start["scheduler"] == before[0][kind]["at"]["scheduler"]
        for local, full in zip(start["local_groups"], start["groups"], strict=True):
            assert set(local["params"]) <= set(full["params"])
            assert {k: v for k, v in local.items() if k != "params"} == {
                k: v for k, v in full.items() if k != "params"
            }
    # the next steps: bitwise as the uninterrupted run at the same world size; at another
    # one the gradient all-reduce sums in another order, so equal up to rounding
    expected, final = before[0][kind]["final"], after[0][kind]["final"]
    for name, param in expected.items():
        if world == SAVED_WORLD:
            assert torch.equal(final[name], param), name
        else:
            torch.testing.assert_close(final[name], param, rtol=0, atol=1e-6)
    assert after[0][kind]["lr"] == before[0][kind]["lr"]


@pytest.mark.timeout(150)
def test_step_lr_drives_the_sharded_adamw(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = saved
    for r in results:
        adamw = r["adamw"]
        # StepLR(step_size=2): halved after steps 2 and 4, in the wrapper's groups and in the
        # partition's (ZeRO copies them before each local step)
        at_save = [lr * zw.GAMMA for lr in zw.LR]
        assert [g["lr"] for g in adamw["at"]["groups"]] == at_save
        assert [g["lr"] for g in adamw["at"]["local_groups"]] == at_save
        assert adamw["lr"] == [lr * zw.GAMMA**2 for lr in zw.LR]
        assert adamw["at"]["groups"][0]["decoupled_weight_decay"] is True
