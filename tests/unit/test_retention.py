import pytest

from lightning_elastic import KeepAll, KeepBestK, KeepEveryNSteps, KeepLastN
from lightning_elastic.core.format.catalog import CORRUPT, INCOMPLETE, VALID, CheckpointInfo
from lightning_elastic.core.format.manifest import ReferenceRecord
from lightning_elastic.core.policy.retention import plan_deletions
from lightning_elastic.errors import ConfigError
from tests.unit.test_manifest import make_manifest


def ckpt(
    step: int,
    run: str = "me",
    status: str = VALID,
    metric: float | None = None,
    refers_to: tuple[int, ...] = (),
) -> CheckpointInfo:
    metrics = {} if metric is None else {"loss": metric}
    references = tuple(
        ReferenceRecord(f"step_{s}", f"save{s}-rank00000.distcp", 10, "ff", 0) for s in refers_to
    )
    manifest = make_manifest(
        step=step,
        run_id=run,
        name=f"step_{step}",
        created_unix=float(step),
        metrics=metrics,
        references=references,
    )
    return CheckpointInfo(
        f"step_{step}", f"/r/step_{step}", status, None if status == INCOMPLETE else manifest
    )


def names(infos) -> list[str]:
    return [i.name for i in infos]


def test_keep_last_n() -> None:
    infos = [ckpt(s) for s in (10, 20, 30, 40)]
    assert names(plan_deletions(infos, [KeepLastN(2)], run_id="me")) == ["step_10", "step_20"]


def test_keep_every_n_steps_milestones_union_with_last() -> None:
    infos = [ckpt(s) for s in range(10, 110, 10)]
    doomed = plan_deletions(infos, [KeepLastN(1), KeepEveryNSteps(50)], run_id="me")
    assert "step_50" not in names(doomed) and "step_100" not in names(doomed)
    assert len(doomed) == 8


@pytest.mark.parametrize(
    ("mode", "kept"), [("min", {"step_20", "step_40"}), ("max", {"step_10", "step_30"})]
)
def test_keep_best_k(mode, kept) -> None:
    infos = [
        ckpt(10, metric=5.0),
        ckpt(20, metric=1.0),
        ckpt(30, metric=4.0),
        ckpt(40, metric=2.0),
        ckpt(50),
    ]
    doomed = plan_deletions(infos, [KeepBestK(2, "loss", mode)], run_id="me")
    # the newest (step 50) survives even without the metric
    survivors = {i.name for i in infos} - set(names(doomed))
    assert survivors == kept | {"step_50"}


def test_best_k_ties_prefer_newer() -> None:
    infos = [ckpt(10, metric=1.0), ckpt(20, metric=1.0), ckpt(30, metric=3.0)]
    doomed = plan_deletions(infos, [KeepBestK(1, "loss", "min")], run_id="me")
    assert names(doomed) == ["step_10"]


def test_never_deletes_other_runs_corrupt_incomplete_or_protected() -> None:
    infos = [
        ckpt(5, run="other"),
        ckpt(10),
        ckpt(15, status=CORRUPT),
        ckpt(20),
        ckpt(25, status=INCOMPLETE),
        ckpt(30),
        ckpt(40),
    ]
    doomed = plan_deletions(infos, [KeepLastN(1)], run_id="me", protected={"step_20"})
    assert names(doomed) == ["step_10", "step_30"]


def test_never_deletes_newest_valid_even_of_another_run() -> None:
    infos = [ckpt(10), ckpt(20), ckpt(30, run="other")]
    doomed = plan_deletions(infos, [KeepLastN(1)], run_id="me")
    assert names(doomed) == ["step_10"]  # step_20 is this run's newest


def test_keep_all_and_no_policy() -> None:
    infos = [ckpt(s) for s in (1, 2, 3)]
    assert plan_deletions(infos, [], run_id="me") == []
    assert plan_deletions(infos, [KeepAll()], run_id="me") == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLastN(0),
        lambda: KeepEveryNSteps(0),
        lambda: KeepBestK(0, "x"),
        lambda: KeepBestK(1, "x", "avg"),
        lambda: KeepBestK(1, ""),
    ],
)
def test_validation(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_a_checkpoint_a_kept_one_refers_to_is_kept_transitively() -> None:
    # 40 -> 30 -> 10 (30 is kept for 40, so what 30 reads is kept too); 20 -> 10 goes
    infos = [
        ckpt(10),
        ckpt(20, refers_to=(10,)),
        ckpt(30, refers_to=(10,)),
        ckpt(40, refers_to=(30,)),
    ]
    assert names(plan_deletions(infos, [KeepLastN(1)], run_id="me")) == ["step_20"]


def test_a_reference_from_a_corrupt_or_another_runs_checkpoint_also_keeps_its_target() -> None:
    # never delete what a checkpoint that stays (for inspection, or another run's) reads from
    infos = [ckpt(10), ckpt(20, status=CORRUPT, refers_to=(10,)), ckpt(30)]
    assert names(plan_deletions(infos, [KeepLastN(1)], run_id="me")) == []


def test_a_doomed_referrer_does_not_keep_its_target() -> None:
    infos = [ckpt(10), ckpt(20, refers_to=(10,)), ckpt(30), ckpt(40, refers_to=(30,))]
    assert names(plan_deletions(infos, [KeepLastN(1)], run_id="me")) == ["step_10", "step_20"]
