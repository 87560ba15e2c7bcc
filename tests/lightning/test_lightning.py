"""DistributedCheckpoint + ElasticStrategy on 2 CPU processes (and 1 for single device)."""

import json
import signal
from pathlib import Path

import pytest

from lightning_elastic import (
    CorruptCheckpointWarning,
    DistributedCheckpoint,
    ElasticStrategy,
    TierOptions,
)
from lightning_elastic.core.observe.history import read_history
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError, ElasticDeprecationWarning
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import workers

pytestmark = pytest.mark.timeout(300)

MAX_STEPS = 20  # 64 samples, 2 ranks x batch 4: 8 steps per epoch -> resume at 10 is mid-epoch


def manifests(root: Path) -> dict[int, dict]:
    out = {}
    for path in sorted((root / "ckpts").glob("*/manifest.json")):
        body = json.loads(path.read_text())
        out[body["step"]] = body
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("uninterrupted")
    return run_distributed(workers.fit, 2, str(root), MAX_STEPS)


def assert_same_tail(reference: dict, resumed: dict, first_step: int) -> None:
    ref = dict(reference["losses"])
    got = dict(resumed["losses"])
    assert sorted(got) == list(range(first_step, MAX_STEPS))
    mismatched = [(s, ref[s], got[s]) for s in got if ref[s] != got[s]]
    assert not mismatched, f"losses differ after resume: {mismatched[:3]}"
    # the same batches, in the same order: nothing replayed or skipped
    assert [s for s in reference["seen"] if s[0] >= first_step] == resumed["seen"]


@pytest.mark.parametrize("strategy", ["elastic", "ddp"])
def test_killed_run_resumes_bitwise(tmp_path, uninterrupted, strategy) -> None:
    run_distributed(workers.fit, 2, str(tmp_path), MAX_STEPS, 13, strategy=strategy, may_die={0, 1})
    assert sorted(manifests(tmp_path)) == [5, 10]
    resumed = run_distributed(workers.fit, 2, str(tmp_path), MAX_STEPS, strategy=strategy)
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith("step_000000010")
        assert_same_tail(uninterrupted[rank], resumed[rank], 10)
        # what resuming cost, per rank: selection + verification + read, and the bytes read
        cost = resumed[rank]["resume_cost"]
        assert cost["location"].endswith("step_000000010") and cost["step"] == 10
        assert cost["seconds"] >= cost["verify_s"] + cost["read_s"] > 0
        assert cost["bytes_read"] > 0
    body = manifests(tmp_path)[20]
    assert body["world_size"] == 2 and body["metadata"]["reason"] in ("step", "train_end")
    assert body["metadata"]["hparams"]["batch_size"] == 4


def test_single_device_resumes_bitwise(tmp_path) -> None:
    reference = workers.fit(str(tmp_path / "ref"), MAX_STEPS, strategy="auto", devices=1)
    assert reference["resume_cost"] is None  # a fresh start loads nothing
    # in-process, a SIGKILL would end pytest: the first run just stops at step 12 unsaved
    workers.fit(str(tmp_path / "run"), 12, strategy="auto", devices=1, save_on_train_end=False)
    resumed = workers.fit(str(tmp_path / "run"), MAX_STEPS, strategy="auto", devices=1)
    assert resumed["resumed_from"].endswith("step_000000010")
    assert_same_tail(reference, resumed, 10)


def test_a_fine_tuning_run_with_incremental_saves_resumes_bitwise(tmp_path) -> None:
    frozen = {"freeze_first": True}
    reference = workers.fit(
        str(tmp_path / "ref"), MAX_STEPS, strategy="auto", devices=1, model_kwargs=frozen
    )
    incremental = {"full_every_n_saves": 4, "model_kwargs": frozen}
    workers.fit(
        str(tmp_path / "run"),
        12,
        strategy="auto",
        devices=1,
        save_on_train_end=False,
        **incremental,
    )
    body = json.loads((tmp_path / "run" / "ckpts" / "step_000000010" / "manifest.json").read_text())
    assert {r["checkpoint"] for r in body["references"]} == {"step_000000005"}  # the frozen layer
    resumed = workers.fit(
        str(tmp_path / "run"), MAX_STEPS, strategy="auto", devices=1, **incremental
    )
    assert resumed["resumed_from"].endswith("step_000000010")
    assert_same_tail(reference, resumed, 10)


def test_autoresume_falls_back_past_corrupt_newest(tmp_path, uninterrupted) -> None:
    run_distributed(workers.fit, 2, str(tmp_path), MAX_STEPS, 18, may_die={0, 1})
    newest = tmp_path / "ckpts" / "step_000000015"
    shard = next(newest.glob("*rank00001.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = run_distributed(workers.fit, 2, str(tmp_path), MAX_STEPS)
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith("step_000000010")
        assert_same_tail(uninterrupted[rank], resumed[rank], 10)
    assert (newest / "_quarantine.json").exists() and shard.exists()  # kept, never deleted


def test_sigterm_on_rank_1_only_checkpoints_and_exits_on_all_ranks(tmp_path) -> None:
    kwargs = {"model_kwargs": {"signal_at": 7, "signal_rank": 1}}
    results = run_distributed(workers.fit, 2, str(tmp_path), 50, every=None, **kwargs, timeout=120)
    for r in results:
        assert r["exit"] == 128 + signal.SIGTERM
        assert r["preempted_by"] == signal.SIGTERM
        assert r["global_step"] == 8  # both ranks stopped at the same step boundary
    body = manifests(tmp_path)[8]
    assert body["metadata"]["reason"] == "signal:SIGTERM"
    resumed = run_distributed(workers.fit, 2, str(tmp_path), 12, every=None)
    assert all(
        r["resumed_from"].endswith("step_000000008") and r["global_step"] == 12 for r in resumed
    )


def test_time_interval_is_agreed_by_all_ranks(tmp_path) -> None:
    kwargs = {"model_kwargs": {"step_sleep": 0.03}}
    results = run_distributed(
        workers.fit, 2, str(tmp_path), 16, every=None, train_time_interval=0.15, **kwargs
    )
    steps = sorted(manifests(tmp_path))
    assert len(steps) >= 3 and steps[-1] == 16  # interval saves plus the one at train end
    assert results[0]["last"] == results[1]["last"]


def test_retention_and_paths(tmp_path) -> None:
    results = run_distributed(workers.fit, 2, str(tmp_path), MAX_STEPS, every=2, keep_last_n=2)
    assert sorted(manifests(tmp_path)) == [18, 20]
    assert (
        results[0]["last"].endswith("step_000000020") and results[0]["last"] == results[1]["last"]
    )


def test_save_checkpoint_and_fit_ckpt_path(tmp_path) -> None:
    results = run_distributed(workers.save_then_fit_ckpt_path, 2, str(tmp_path))
    assert (tmp_path / "manual.ckpt" / "manifest.json").exists()
    for r in results:
        assert r["steps"] == [6, 7, 8] and r["ckpt_path"].endswith("manual.ckpt")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"train_time_interval": -1}, "train_time_interval"),
        ({"keep_best_k": 2}, "monitor"),
        ({"mode": "avg"}, "mode"),
        ({"resume": "maybe"}, "resume"),
        ({"signals": ["SIGNOPE"]}, "signal"),
        ({"when_busy": "queue"}, "when_busy"),
        ({"compression": "lz4"}, "compression"),
        ({"full_every_n_saves": 0}, "full_every_n_saves"),
        ({"full_every_n_saves": 2.0}, "full_every_n_saves must be an integer"),
        ({"full_every_n_saves": 4, "tiers": TierOptions("/tmp/l")}, "not supported with tiers"),
        ({"keep_last_n": 0}, "keep_last_n"),
        # nothing is coerced: YAML makes these easy to write
        ({"every_n_train_steps": 2.5}, "every_n_train_steps must be an integer"),
        ({"every_n_train_steps": "5"}, "every_n_train_steps must be an integer"),
        ({"every_n_train_steps": True}, "every_n_train_steps must be an integer"),
        ({"keep_last_n": 2.0}, "keep_last_n must be an integer"),
        ({"every_n_epochs": "1"}, "every_n_epochs"),
        ({"async_save": "yes"}, "async_save must be True or False"),
        ({"train_time_interval": float("nan")}, "train_time_interval"),
        ({"signals": "SIGNOPE"}, "unknown signal 'SIGNOPE'"),
        ({"signals": [1.5]}, "not a signal name or number"),
        ({"monitor": ""}, "monitor"),
        ({"run_name": "../elsewhere"}, "run_name must be 1-128 letters"),
        ({"run_name": 7}, "run_name must be 1-128 letters"),
        ({"run_name": "a" * 129}, "run_name must be 1-128 letters"),
        ({"signals": "SIGKILL"}, "SIGKILL cannot be caught"),
        ({"signals": b"SIGTERM"}, "not a signal name or number"),
    ],
)
def test_options_are_validated(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        DistributedCheckpoint("/tmp/x", **kwargs)


STRATEGY_OPTIONS = [
    ({"verify": "md5"}, "verify"),
    ({"trusted": 1}, "trusted must be True or False"),
    ({"timeout": "10"}, r"timeout must be a duration \(a timedelta or seconds\)"),
    ({"timeout": float("inf")}, r"timeout must be a duration .* in \[1e-06, "),
    ({"timeout": 1e300}, r"timeout must be .* 3\.1536e\+07\] s \(at most a year\)"),
    ({"storage_options": "anon=true"}, "storage_options must be a dict"),
]


@pytest.mark.parametrize(("kwargs", "match"), STRATEGY_OPTIONS)
def test_the_strategy_options_on_the_callback_are_deprecated_and_still_checked(
    kwargs, match
) -> None:
    ((name, value),) = kwargs.items()
    new = "checkpoint_timeout" if name == "timeout" else name
    with (
        pytest.warns(ElasticDeprecationWarning, match=rf"use ElasticStrategy\({new}=\.\.\.\)"),
        pytest.raises(ConfigError, match=match),
    ):
        DistributedCheckpoint("/tmp/x", **kwargs)
    with pytest.raises(ConfigError, match=match.replace("timeout must", "checkpoint_timeout must")):
        ElasticStrategy(**{new: value})


@pytest.mark.parametrize("name", ["FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy"])
def test_unsupported_strategy_fails_at_setup(name) -> None:
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    from lightning.pytorch import strategies

    from lightning_elastic.lightning.supported import check_strategy

    # DeepSpeedStrategy is a DDPStrategy: refused all the same
    trainer = SimpleNamespace(strategy=MagicMock(spec=getattr(strategies, name)))
    with pytest.raises(ConfigError, match=r"'elastic'.*'elastic_fsdp'") as raised:
        check_strategy(trainer)  # type: ignore[arg-type]
    assert name in str(raised.value)


def test_fsdp_strategy_options_are_validated() -> None:
    import lightning.pytorch as pl

    from lightning_elastic import ElasticFSDPStrategy

    for kwargs, match in [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"data_parallel_size": "all"}, "data_parallel_size"),
        ({"verify": "sometimes"}, "verify"),
        ({"global_batch_size": -4}, "global_batch_size"),
        ({"storage_options": "key=x"}, "storage_options"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ElasticFSDPStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="elastic_fsdp", logger=False)
    assert isinstance(trainer.strategy, ElasticFSDPStrategy)


def test_corrupt_warning_type_is_public() -> None:
    assert issubclass(CorruptCheckpointWarning, UserWarning)


def test_stats_are_logged_and_best_is_tracked(tmp_path) -> None:
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from tests.lightning.models import TinyModule, make_trainer

    class Logged(TinyModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            # a synthetic "score" whose best value is at step 6
            self.log("score", abs(self.global_step - 6.0))
            return loss

    pl.seed_everything(7, verbose=False)
    checkpoint = DistributedCheckpoint(
        tmp_path / "ckpts",
        every_n_train_steps=3,
        monitor="score",
        mode="min",
        keep_best_k=1,
        keep_last_n=1,
    )
    trainer = make_trainer(
        str(tmp_path),
        max_steps=12,
        strategy="auto",
        devices=1,
        callbacks=[checkpoint],
        log_every_n_steps=1,
    )
    trainer.logger = CSVLogger(str(tmp_path), name="logs")
    trainer.fit(Logged())
    with open(next((tmp_path / "logs").rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("checkpoint/blocked_s")]
    assert len(logged) >= 3
    assert all(float(r["checkpoint/bytes"]) > 0 and float(r["checkpoint/GBps"]) > 0 for r in logged)
    # score logged at step s is |s - 6| with s counted before the step: best is the step-6 save
    assert checkpoint.best_model_path.endswith("step_000000006")
    assert checkpoint.last_model_path.endswith("step_000000012")
    kept = sorted(p.name for p in (tmp_path / "ckpts").glob("step_*"))
    assert kept == ["step_000000006", "step_000000012"]  # best 1 + last 1


def test_checkpoint_requested_on_one_rank(tmp_path) -> None:
    results = run_distributed(workers.fit_with_request, 2, str(tmp_path), timeout=120)
    assert sorted(manifests(tmp_path)) == [3]
    assert manifests(tmp_path)[3]["metadata"]["reason"] == "request"
    assert results[0]["last"] == results[1]["last"]


def test_background_failure_surfaces_on_every_rank_at_the_same_step(tmp_path) -> None:
    from lightning_elastic.testing.faults import Fault

    faults = [Fault("write", "*rank00001.distcp", "EACCES", skip=1, times=0, ranks=(1,))]
    results = run_distributed(
        workers.fit_with_failing_storage, 2, str(tmp_path), faults, timeout=120
    )
    steps = {r["step"] for r in results}
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
    for r in results:
        assert r["error"] is not None and r["error"].failed_ranks == [1]
        assert r["error"].phases == {"write"}
        assert r["metrics"]["lightning_elastic_save_failures_total/write"] == 1.0
    assert sorted(manifests(tmp_path)) == [2]  # the failed save committed nothing
    failed = [
        e.fields
        for e in read_history(Storage(str(tmp_path / "ckpts")))[0]
        if e.kind == "save_failed"
    ]
    assert [(f["step"], f["phase"]) for f in failed] == [(4, "write")]


def test_every_n_epochs(tmp_path) -> None:
    # single device: 64 samples / batch 4 = 16 steps per epoch
    workers.fit(str(tmp_path), 40, every=None, strategy="auto", devices=1, every_n_epochs=1)
    steps = {step: body["metadata"]["reason"] for step, body in manifests(tmp_path).items()}
    # max_steps ends epoch 2 early and Lightning still runs its epoch-end hooks: that save is
    # an epoch save, and the train-end save does not repeat it
    assert steps == {16: "epoch", 32: "epoch", 40: "epoch"}
