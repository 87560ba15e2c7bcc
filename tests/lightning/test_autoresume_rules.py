"""Autoresume that does not surprise, and options that are strict and single-sourced (#14
items 3 and 5), on one process: run identity (``run_name``), the loud resume line, a finished
run, a different model, other hyperparameters, a misspelled ``monitor``, a bad ``dirpath`` at
setup, one checkpoint timeout."""

from __future__ import annotations

import logging
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_elastic import CheckpointEngine, DistributedCheckpoint, ElasticStrategy
from lightning_elastic.errors import (
    CheckpointMismatchError,
    ConfigError,
    ElasticDeprecationWarning,
)

pytestmark = pytest.mark.timeout(300)


class Net(pl.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1, log_val: str = "val_loss") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, hidden)
        self.head = torch.nn.Linear(hidden, 1)
        self.steps_trained = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layer(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_trained += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log(self.hparams.log_val, torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def _data(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1)), 4)

    def train_dataloader(self) -> DataLoader:
        return self._data()

    def val_dataloader(self) -> DataLoader:
        return self._data()


def trainer_for(
    dirpath: Path | str,
    *,
    max_steps: int = 4,
    strategy: Any = "auto",
    max_epochs: int | None = None,
    validate: bool = True,
    **callback: Any,
) -> tuple[pl.Trainer, DistributedCheckpoint]:
    checkpoint = DistributedCheckpoint(
        str(dirpath), every_n_train_steps=2, async_save=False, signals=(), **callback
    )
    trainer = pl.Trainer(
        default_root_dir=str(Path(str(dirpath)).parent),
        max_steps=max_steps,
        max_epochs=max_epochs,
        limit_val_batches=2 if validate else 0,
        val_check_interval=2 if validate else None,
        devices=1,
        strategy=strategy,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return trainer, checkpoint


def fit(
    dirpath: Path | str, model: Net | None = None, **options: Any
) -> tuple[Net, DistributedCheckpoint]:
    model = model or Net()
    trainer, checkpoint = trainer_for(dirpath, **options)
    trainer.fit(model)
    return model, checkpoint


def run_ids(root: Path) -> set[str]:
    import json

    return {json.loads(p.read_text())["run_id"] for p in root.glob("*/manifest.json")}


def test_run_name_scopes_autoresume_and_is_recorded(tmp_path: Path, caplog) -> None:
    root = tmp_path / "ckpts"
    fit(root, run_name="a")
    assert run_ids(root) == {"a"}
    other, _ = fit(root, run_name="b", max_steps=4)  # another run in the same folder
    assert other.steps_trained == 4, "run b must start fresh, not continue run a"
    assert run_ids(root) == {"a", "b"}
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        again, _ = fit(root, run_name="a", max_steps=6)
    assert again.steps_trained == 2, "run a continues from its own step 4"
    line = next(r.getMessage() for r in caplog.records if "resume='auto'" in r.getMessage())
    assert "continuing run 'a'" in line and "step 4" in line and "of this run_name" in line


def test_finished_run_says_it_trains_nothing(tmp_path: Path, caplog) -> None:
    fit(tmp_path / "ckpts")
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        model, _ = fit(tmp_path / "ckpts")
    assert model.steps_trained == 0
    text = caplog.text
    assert "max_steps=4 already reached" in text and "trains nothing" in text
    assert "resume='never'" in text


def test_a_different_model_is_named_not_a_bare_size_mismatch(tmp_path: Path) -> None:
    fit(tmp_path / "ckpts")
    with pytest.raises(CheckpointMismatchError) as info:
        fit(tmp_path / "ckpts", Net(hidden=16), max_steps=6)
    message = str(info.value)
    assert "written by a different model" in message
    assert "'layer.weight' has shape (8, 4) in the checkpoint, (16, 4) in this model" in message
    assert "resume='never'" in message


def test_other_hyperparameters_are_said_out_loud(tmp_path: Path, caplog) -> None:
    fit(tmp_path / "ckpts")
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        model, _ = fit(tmp_path / "ckpts", Net(lr=0.5), max_steps=6)
    assert model.steps_trained == 2
    assert "lr: 0.1 in the checkpoint, 0.5 now" in caplog.text


def test_resume_never_starts_fresh(tmp_path: Path) -> None:
    fit(tmp_path / "ckpts")
    model, _ = fit(tmp_path / "ckpts", resume="never")
    assert model.steps_trained == 4


def test_misspelled_monitor_raises_at_the_first_validation(tmp_path: Path) -> None:
    model = Net()
    with pytest.raises(ConfigError, match=r"monitor='val_los'.*logged: val_loss"):
        fit(tmp_path / "ckpts", model, monitor="val_los")
    assert model.steps_trained == 2  # the first validation runs after step 2


def test_monitor_logged_by_validation_is_recorded(tmp_path: Path) -> None:
    _, checkpoint = fit(tmp_path / "ckpts", monitor="val_loss", keep_best_k=1)
    assert checkpoint.best_model_score is not None


@pytest.mark.parametrize("kind", ["a file", "below a file", "not creatable"])
def test_a_bad_dirpath_fails_at_setup(tmp_path: Path, kind: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    dirpath = {
        "a file": afile,
        "below a file": afile / "ckpts",
        "not creatable": Path("/proc/lightning_elastic_nope/ckpts"),
    }[kind]
    model = Net()
    with pytest.raises(ConfigError, match=r"cannot write checkpoints to .*storage options"):
        fit(dirpath, model)
    assert model.steps_trained == 0, "the error must come before training starts"
    assert afile.read_text() == "not a folder"


def test_one_checkpoint_timeout(tmp_path: Path) -> None:
    # the callback's old spelling still works (here with Lightning's single-device strategy,
    # before an ElasticStrategy leaves a process group behind) ...
    with pytest.warns(ElasticDeprecationWarning, match=r"ElasticStrategy\(checkpoint_timeout="):
        _, checkpoint = fit(tmp_path / "d", timeout=30.0)
    assert checkpoint._session is not None
    assert checkpoint._session.timeout == timedelta(seconds=30)
    # ... but the strategy's value is the one to set (examples/config.yaml sets it there)
    _, checkpoint = fit(tmp_path / "b", strategy=ElasticStrategy(checkpoint_timeout=42))
    assert checkpoint._session is not None
    assert checkpoint._session.timeout == timedelta(seconds=42)
    # two different values are refused
    with (
        pytest.warns(ElasticDeprecationWarning),
        pytest.raises(ConfigError, match="two different checkpoint timeouts"),
    ):
        fit(
            tmp_path / "a",
            strategy=ElasticStrategy(checkpoint_timeout=timedelta(minutes=5)),
            timeout=60,
        )
    with pytest.warns(ElasticDeprecationWarning):  # equal values in both places: accepted
        fit(tmp_path / "c", strategy=ElasticStrategy(checkpoint_timeout=30), timeout=30.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shard_optimizer_state": "yes"}, "shard_optimizer_state must be True or False"),
        ({"global_batch_size": 8.0}, "global_batch_size must be an integer"),
        ({"checkpoint_timeout": "600"}, "checkpoint_timeout"),
        ({"storage_options": "anon=true"}, "storage_options must be a dict"),
    ],
)
def test_strategy_options_are_strict(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ElasticStrategy(**kwargs)


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        ("SIGTERM", (signal.SIGTERM,)),
        ("SIGTERM, usr1", (signal.SIGTERM, signal.SIGUSR1)),
        (["SIGUSR2", int(signal.SIGTERM)], (signal.SIGUSR2, signal.SIGTERM)),
        ((), ()),
    ],
)
def test_signals_accept_one_name_a_list_or_a_comma_list(signals: Any, expected: tuple) -> None:
    assert DistributedCheckpoint("/tmp/x", signals=signals).signals == tuple(map(int, expected))


def test_dirpath_must_be_a_path() -> None:
    with pytest.raises(ConfigError, match="dirpath must be a path"):
        DistributedCheckpoint(3)  # type: ignore[arg-type]


@pytest.mark.s3
def test_an_unreachable_bucket_fails_at_setup(s3_server) -> None:
    model = Net()
    with pytest.raises(ConfigError, match="cannot write checkpoints to s3://no-such-bucket"):
        fit(
            "s3://no-such-bucket/ckpts",
            model,
            strategy=ElasticStrategy(storage_options=s3_server.storage_options),
        )
    assert model.steps_trained == 0


def leases(root: Path, run: str) -> list[str]:
    return sorted(p.name for p in (root / ".leases" / run).glob("gen-*.json"))


def test_only_a_fit_that_continues_the_run_takes_it_over(tmp_path: Path) -> None:
    """Evaluating or reading a run's checkpoint never fences the job that writes it (its next
    save would fail with StaleWriterError); a fit that resumes it does."""
    root = tmp_path / "ckpts"
    fit(root, run_name="a")
    before = leases(root, "a")
    assert len(before) == 1
    trainer, _ = trainer_for(root, run_name="a")
    trainer.validate(Net(), ckpt_path="last")
    trainer, _ = trainer_for(root, run_name="a")
    trainer.validate(Net(), ckpt_path=str(root / "step_000000004"))
    with CheckpointEngine(str(root)) as reader:  # docs/resuming.md "From Python"
        reader.load(None, trusted=True)
    assert leases(root, "a") == before
    with pytest.raises(CheckpointMismatchError):  # refused before taking anything over
        fit(root, Net(hidden=16), run_name="a", max_steps=6)
    assert leases(root, "a") == before
    fit(root, run_name="a", max_steps=6)
    assert len(leases(root, "a")) == 2


def test_an_unnamed_job_never_continues_a_named_run(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    fit(root, run_name="b", keep_last_n=3)
    named = sorted(p.name for p in root.glob("step_*"))
    model, _ = fit(root, max_steps=6, keep_last_n=1)
    assert model.steps_trained == 6, "the unnamed job must start its own run"
    assert set(named) <= {p.name for p in root.glob("step_*")}, "b's checkpoints deleted"
    assert run_ids(root) - {"b"}, "the unnamed job's checkpoints carry their own run id"


def test_a_mid_epoch_max_steps_stop_is_not_a_finished_epoch(tmp_path: Path, caplog) -> None:
    root = tmp_path / "ckpts"
    fit(root, max_steps=4, max_epochs=1)  # 8 batches per epoch: stops inside epoch 0
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        model, _ = fit(root, max_steps=100, max_epochs=1)
    assert model.steps_trained == 4
    assert "trains nothing" not in caplog.text
    assert "step 4, epoch 0" in caplog.text
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        model, _ = fit(root, max_steps=100, max_epochs=1)
    assert model.steps_trained == 0 and "max_epochs=1 already reached" in caplog.text


class Loose(Net):
    strict_loading = False


def test_shapes_are_checked_also_without_strict_loading(tmp_path: Path) -> None:
    fit(tmp_path / "ckpts", Loose())
    with pytest.raises(CheckpointMismatchError, match=r"'layer\.weight' has shape"):
        fit(tmp_path / "ckpts", Loose(hidden=16), max_steps=6)


def test_a_monitor_no_validation_logs_raises_at_the_first_save(tmp_path: Path) -> None:
    model = Net()
    with pytest.raises(ConfigError, match=r"monitor='val_loss'.*runs no validation"):
        fit(tmp_path / "ckpts", model, monitor="val_loss", keep_best_k=1, validate=False)
    assert model.steps_trained == 2


class Thing:
    pass


def test_identical_hyperparameters_do_not_warn(tmp_path: Path, caplog) -> None:
    from lightning_elastic.lightning.session import _jsonable, hparams_difference

    saved = _jsonable({"tags": {"x", "y", "z"}, "things": [Thing()], "lr": 0.1})
    again = _jsonable({"tags": {"z", "x", "y"}, "things": [Thing()], "lr": 0.1})
    assert hparams_difference(saved, again) is None
    assert hparams_difference(saved, {**again, "lr": 0.2}) == ("lr: 0.1 in the checkpoint, 0.2 now")
