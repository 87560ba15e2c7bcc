"""After a world-size change, every later epoch is whole: the loop counts the full epoch at the
new world size, sees every sample once, and epoch-level behaviour (epoch end, epoch-interval
scheduler, validation, limits, max_epochs) lands on the true boundaries.

42 samples (a multiple of 1, 2 and 3, so nothing is padded or dropped), batch 4 per rank:
a full epoch is 11 batches at 1 rank, 6 at 2, 4 at 3. Checkpoints at every step; every rank
dies at ``kill`` (mid-epoch 0 unless said otherwise) and the next world resumes there.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

from lightning_elastic.testing.spawn import WorkerFailure, run_distributed
from tests.elastic import epoch_workers, journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
N = 42
EPOCHS = 4  # the resumed epoch plus three full ones


def full_epoch(world: int, global_batch_size: int | None = None) -> int:
    per_rank_batch = 4 if global_batch_size is None else global_batch_size // world
    return -(-(N // world) // per_rank_batch)


def run_plan(root: str, plan: list[tuple[int, int]], **kwargs: Any) -> dict[str, Any]:
    """Run each (world, kill step) in turn (kill -1: run to the end); return the last run's
    rank-0 result and the journal of the run that counts."""
    for world, kill in plan:
        may_die = set(range(world)) if kill >= 0 else set()
        results = run_distributed(
            epoch_workers.epoch_fit,
            world,
            root,
            max_epochs=EPOCHS,
            kill_at=kill,
            may_die=may_die,
            timeout=180,
            **kwargs,
        )
    records = journal.read(f"{root}/journal")
    last = max(r["inc"] for r in records)
    return {
        "result": results[0],
        "steps": journal.effective_steps(records),
        # rank 0 of the last worker group: every epoch it ended, every validation it ran
        "epoch_ends": [
            r
            for r in records
            if r["kind"] == "epoch_end" and r["inc"] == last and "rank0" in r["file"]
        ],
        "vals": [
            r for r in records if r["kind"] == "val" and r["inc"] == last and "rank0" in r["file"]
        ],
    }


def samples_per_epoch(steps: dict[int, dict]) -> dict[int, collections.Counter]:
    assert sorted(steps) == list(range(len(steps))), "a step is missing"
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in steps.values():
        per_epoch[record["epoch"]].update(record["ids"])
    return dict(per_epoch)


def assert_whole_epochs(run: dict[str, Any], new_world: int, gbs: int | None = None) -> None:
    per_epoch = samples_per_epoch(run["steps"])
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, counts in per_epoch.items():
        assert counts == collections.Counter(range(N)), (
            f"epoch {epoch}: {sum(counts.values())} samples, {len(counts)} distinct of {N}"
        )
    full = full_epoch(new_world, gbs)
    ends = run["epoch_ends"]
    first = ends[0]["epoch"]  # the epoch the last group resumed in
    assert [e["epoch"] for e in ends] == list(range(first, EPOCHS)), "one epoch end per epoch"
    for end in ends:
        # StepLR(step_size=1, gamma=0.5), interval="epoch": stepped once per epoch, on its
        # last batch (before on_train_epoch_end)
        assert end["lr"] == pytest.approx(0.5 ** (end["epoch"] + 1)), end
        if end["epoch"] > first:
            assert end["batches"] == end["num_training_batches"] == full, end
    # validation once per epoch, on its last batch
    vals = run["vals"]
    assert [v["epoch"] for v in vals] == list(range(first, EPOCHS))
    for val, end in zip(vals, ends, strict=True):
        assert val["step"] == end["step"], (val, end)
    result = run["result"]
    assert result["current_epoch"] == EPOCHS
    assert result["global_step"] == len(run["steps"]) == ends[-1]["step"]
    assert result["num_training_batches"] == full


@pytest.mark.parametrize(
    ("first", "second", "kill", "drop_last", "gbs"),
    [
        (2, 1, 3, False, None),
        (3, 2, 2, True, 12),
        (3, 1, 2, True, None),
        (1, 2, 2, False, 12),
        (2, 3, 3, False, None),
    ],
    ids=["2to1", "3to2-droplast-gbs", "3to1-droplast", "1to2-gbs", "2to3"],
)
def test_every_later_epoch_is_whole_after_a_change(
    tmp_path, first, second, kill, drop_last, gbs
) -> None:
    run = run_plan(
        str(tmp_path),
        [(first, kill), (second, -1)],
        drop_last=drop_last,
        global_batch_size=gbs,
        validate=True,
    )
    assert run["result"]["resumed_from"].endswith(f"step_{kill:09d}")
    assert_whole_epochs(run, second, gbs)


def test_two_changes_inside_one_epoch(tmp_path) -> None:
    # 3 ranks train 12 samples, 2 ranks 16 more (still epoch 0), 1 rank the rest and 3 epochs
    run = run_plan(str(tmp_path), [(3, 1), (2, 3), (1, -1)], validate=True)
    assert run["epoch_ends"][0]["epoch"] == 0
    assert_whole_epochs(run, 1)


def test_a_change_on_the_epochs_last_batch(tmp_path) -> None:
    # step 6 is the last batch of epoch 0 at 2 ranks; 1 rank resumes at the epoch boundary
    run = run_plan(str(tmp_path), [(2, full_epoch(2)), (1, -1)], validate=True)
    assert run["epoch_ends"][0]["epoch"] == 1
    assert_whole_epochs(run, 1)


@pytest.mark.parametrize(
    ("trainer_kwargs", "batches", "val_batches"),
    [
        # 11 batches at 1 rank: half is 5, validation every int(5 * 0.5) = 2 batches
        ({"limit_train_batches": 0.5, "val_check_interval": 0.5}, 5, {1, 3}),
        # 7 batches of 11; validation every second epoch, on its last batch
        ({"limit_train_batches": 7, "check_val_every_n_epoch": 2}, 7, {6}),
    ],
    ids=["fractions", "int-limit"],
)
def test_limits_and_validation_land_on_the_new_epoch(
    tmp_path, trainer_kwargs, batches, val_batches
) -> None:
    run = run_plan(str(tmp_path), [(2, 2), (1, -1)], validate=True, trainer_kwargs=trainer_kwargs)
    later = [e for e in run["epoch_ends"] if e["epoch"] > 0]
    assert [e["epoch"] for e in later] == list(range(1, EPOCHS))
    for end in later:
        assert end["batches"] == end["num_training_batches"] == batches, end
        assert end["lr"] == pytest.approx(0.5 ** (end["epoch"] + 1))
    per_epoch = samples_per_epoch(run["steps"])
    for epoch in range(1, EPOCHS):  # a limit takes the epoch's first samples, each once
        assert sum(per_epoch[epoch].values()) == len(per_epoch[epoch]) == batches * 4
    every = trainer_kwargs.get("check_val_every_n_epoch", 1)
    for epoch in range(1, EPOCHS):
        seen = {v["batch_idx"] for v in run["vals"] if v["epoch"] == epoch}
        assert seen == (val_batches if (epoch + 1) % every == 0 else set()), epoch
    steps = run["result"]["global_step"]
    assert steps == len(run["steps"]) == later[-1]["step"]
    assert steps - later[0]["step"] == batches * (EPOCHS - 2)


def test_a_whole_number_val_interval_longer_than_the_new_epoch_fails_at_setup(tmp_path) -> None:
    # 8 batches fit an epoch at 1 rank (11) but not at 2 (6): validation would never run
    kwargs = {"validate": True, "trainer_kwargs": {"val_check_interval": 8}}
    root = str(tmp_path)
    run_distributed(
        epoch_workers.epoch_fit, 1, root, max_epochs=EPOCHS, kill_at=4, may_die={0}, **kwargs
    )
    with pytest.raises(WorkerFailure) as failure:
        run_distributed(epoch_workers.epoch_fit, 2, root, max_epochs=EPOCHS, **kwargs)
    errors = failure.value.errors
    assert {e.type_name for e in errors.values()} == {"ConfigError"}  # type: ignore[union-attr]
    assert "val_check_interval=8" in str(failure.value)
