"""When a checkpoint is taken: after everything Lightning does for its step (validation,
EarlyStopping, ReduceLROnPlateau, epoch end), and only at optimizer-step boundaries.

Each case compares an uninterrupted run with one SIGKILLed after a checkpoint and resumed:
per-batch losses, learning rates, EarlyStopping counters and the loggers' step must be equal
bitwise, and each manifest's ``val_loss`` must be the one of the last validation at or before
its step. 2 CPU ranks, 64 samples, 2 x batch 4: 8 steps per epoch.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import boundary_workers
from tests.lightning.test_lightning import manifests

pytestmark = pytest.mark.timeout(240)

MAX_STEPS = 20

# name: (trainer kwargs, model kwargs); the plateau scheduler steps right after each validation
VALIDATION = {
    "val_every_4": ({"val_check_interval": 4}, {"plateau_frequency": 4}),
    "val_every_5": ({"val_check_interval": 5}, {"plateau_frequency": 5}),
    "val_epoch_end": ({"val_check_interval": 1.0}, {"plateau_interval": "epoch"}),
    "val_every_2nd_epoch": (
        {"check_val_every_n_epoch": 2},
        {"plateau_interval": "epoch", "plateau_frequency": 2},
    ),
}

# (validation, checkpoint every_n_train_steps, kill at step, expected resume step)
GRID = [
    pytest.param("val_every_4", 4, 10, 8, id="val4-ckpt4-coincide-at-epoch-end"),
    pytest.param("val_every_4", 4, 14, 12, id="val4-ckpt4-coincide-mid-epoch"),
    pytest.param("val_every_5", 4, 14, 12, id="val5-ckpt4"),
    pytest.param("val_epoch_end", 4, 10, 8, id="val-epoch-end-ckpt4"),
    pytest.param("val_every_2nd_epoch", 4, 18, 16, id="val-every-2nd-epoch-ckpt4"),
]


def fit(root: Path, validation: str, *args: Any, **kwargs: Any) -> list[dict]:
    trainer_kwargs, model_kwargs = VALIDATION[validation]
    return run_distributed(
        boundary_workers.fit,
        2,
        str(root),
        *args,
        trainer_kwargs=trainer_kwargs,
        model_kwargs=model_kwargs,
        timeout=120,
        **kwargs,
    )


_references: dict[tuple[str, int], tuple[Path, list[dict]]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per (validation, every), shared by the cases."""

    def get(validation: str, every: int) -> tuple[Path, list[dict]]:
        key = (validation, every)
        if key not in _references:
            root = tmp_path_factory.mktemp(f"ref-{validation}-{every}")
            _references[key] = (root, fit(root, validation, MAX_STEPS, every=every))
        return _references[key]

    yield get
    _references.clear()


def assert_same_from(reference: dict, resumed: dict, first_step: int) -> None:
    expected = [r for r in reference["records"] if r[0] >= first_step]
    got = resumed["records"]
    assert [r[:2] for r in got] == [r[:2] for r in expected], "different batches after resume"
    mismatched = [(e, g) for e, g in zip(expected, got, strict=True) if e != g]
    # (step, batch, loss, lrs, EarlyStopping wait_count, best_score, loggers' step)
    assert not mismatched, f"state differs after resume: {mismatched[:2]}"
    assert [s for s in reference["seen"] if s[0] >= first_step] == resumed["seen"]
    assert [v for v in reference["val_losses"] if v[0] > first_step] == resumed["val_losses"]
    assert resumed["wait_count"] == reference["wait_count"]
    assert resumed["lrs"] == reference["lrs"]


def assert_monitor_is_that_steps(root: Path, val_losses: list[tuple[int, float]]) -> None:
    """Each checkpoint records the val_loss of the last validation at or before its step."""
    bodies = manifests(root)
    assert bodies
    for step, body in bodies.items():
        before = [v for s, v in val_losses if s <= step]
        if before:
            assert body["metrics"] == {"val_loss": before[-1]}, f"step {step}"
        else:
            assert body["metrics"] == {}, f"step {step}"


@pytest.mark.parametrize(("validation", "every", "kill_at", "resume_at"), GRID)
def test_resume_after_a_checkpoint_repeats_nothing_and_skips_nothing(
    tmp_path, reference, validation, every, kill_at, resume_at
) -> None:
    ref_root, ref = reference(validation, every)
    assert ref[0]["val_losses"], "the reference never validated"
    assert_monitor_is_that_steps(ref_root, ref[0]["val_losses"])
    fit(tmp_path, validation, MAX_STEPS, kill_at, every=every, may_die={0, 1})
    assert max(manifests(tmp_path)) == resume_at
    assert_monitor_is_that_steps(tmp_path, ref[0]["val_losses"])
    resumed = fit(tmp_path, validation, MAX_STEPS, every=every)
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith(f"step_{resume_at:09d}")
        assert_same_from(ref[rank], resumed[rank], resume_at)


# ---------------------------------------------------------------- gradient accumulation

ACC_STEPS = 9  # accumulate 3: windows of 3, 3, 2 batches per 8-batch epoch, 3 steps per epoch
ACCUMULATE = {"accumulate_grad_batches": 3}


def fit_accumulating(
    root: Path, *args: Any, model_kwargs: dict | None = None, **kwargs: Any
) -> list[dict]:
    # validation at each epoch's end; the plateau scheduler steps after it
    model = {"plateau_interval": "epoch", **(model_kwargs or {})}
    return run_distributed(
        boundary_workers.fit,
        2,
        str(root),
        *args,
        trainer_kwargs=ACCUMULATE,
        model_kwargs=model,
        timeout=120,
        **kwargs,
    )


@pytest.fixture(scope="module")
def accumulating_reference(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("ref-accumulating")
    return fit_accumulating(root, ACC_STEPS, every=None, save_on_train_end=False)


def assert_same_batches_from(reference: dict, resumed: dict, first_batch: int) -> None:
    expected = [r for r in reference["records"] if r[1] >= first_batch]
    assert resumed["records"] == expected
    assert resumed["lrs"] == reference["lrs"]


def test_request_mid_window_saves_at_the_windows_end(tmp_path, accumulating_reference) -> None:
    # batch 4 is the middle of the second window (batches 3, 4, 5): the save is step 2's
    model = {"request_at": (1, 4)}
    kwargs = {"every": None, "save_on_train_end": False, "signals": ()}
    fit_accumulating(tmp_path, ACC_STEPS, 4, model_kwargs=model, may_die={0, 1}, **kwargs)
    bodies = manifests(tmp_path)
    assert sorted(bodies) == [2] and bodies[2]["metadata"]["reason"] == "request"
    resumed = fit_accumulating(tmp_path, ACC_STEPS, every=None, save_on_train_end=False)
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith("step_000000002")
        assert_same_batches_from(accumulating_reference[rank], resumed[rank], 6)


def test_sigterm_mid_window_checkpoints_at_the_windows_end_and_exits_everywhere(
    tmp_path, accumulating_reference
) -> None:
    model = {"sigterm_at": (1, 4)}
    results = fit_accumulating(tmp_path, ACC_STEPS, every=None, model_kwargs=model)
    for r in results:
        assert r["exit"] == 128 + signal.SIGTERM
        assert r["preempted_by"] == signal.SIGTERM
        assert r["global_step"] == 2  # the window's end, on every rank
    bodies = manifests(tmp_path)
    assert sorted(bodies) == [2] and bodies[2]["metadata"]["reason"] == "signal:SIGTERM"
    resumed = fit_accumulating(tmp_path, ACC_STEPS, every=None, save_on_train_end=False)
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith("step_000000002")
        assert_same_batches_from(accumulating_reference[rank], resumed[rank], 6)
