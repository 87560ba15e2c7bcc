"""Loading our checkpoint directories the Lightning way: ``load_from_checkpoint``,
``validate/test/predict(ckpt_path=DIR)``, ``ckpt_path="last"/"best"``, ``load_weights``; one
process (and one test whose checkpoint was written by two)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_elastic.lightning  # noqa: F401  (what teaches Lightning our directories)
from lightning_elastic import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointWarning,
    DistributedCheckpoint,
    WeightsMismatchError,
    consolidate,
    load_weights,
)
from lightning_elastic.lightning.loading import load_elastic_checkpoint
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import loading_workers
from tests.lightning.models import IdDataset, TinyModule, make_trainer

pytestmark = [
    pytest.mark.timeout(300),
    # Lightning's advice for tiny CPU runs, not about what is tested here
    pytest.mark.filterwarnings("ignore:The '\\w+_dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*the number of the training batches.*"),
    # evaluating a checkpoint under another callback (dirpath) than the one that wrote it
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks"),
]


class Scored(TinyModule):
    """TinyModule with a synthetic ``score`` whose best (lowest) value is the step-6 save, and
    validation, test and predict steps."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        # as in test_lightning's Logged: of saves every 3 steps, step 6's scores best
        self.log("score", abs(self.global_step - 6.0))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        # no validation runs during these fits (fewer steps than an epoch): logged so that
        # validate() sees the monitored name too, as with a real validation metric
        self.log("score", loss)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[1])

    def _eval_loader(self) -> DataLoader:
        return DataLoader(IdDataset(8), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader()


def fit(root: Path, max_steps: int = 12, **callback: Any) -> tuple[pl.Trainer, Scored]:
    pl.seed_everything(7, verbose=False)
    model = Scored(hidden=16)
    checkpoint = DistributedCheckpoint(root / "ckpts", every_n_train_steps=3, **callback)
    trainer = make_trainer(
        str(root), max_steps=max_steps, strategy="auto", devices=1, callbacks=[checkpoint]
    )
    trainer.fit(model)
    return trainer, model


def trainer_with(root: Path, max_steps: int = 12, **callback: Any) -> pl.Trainer:
    """A fresh Trainer (as after a restart) whose checkpoint callback is ours."""
    checkpoint = DistributedCheckpoint(root / "ckpts", **callback)
    return make_trainer(
        str(root), max_steps=max_steps, strategy="auto", devices=1, callbacks=[checkpoint]
    )


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return consolidate(directory)["state_dict"]


def assert_weights(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = module.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k].cpu(), expected[k]) for k in got), "other weights loaded"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run: checkpoints at steps 3, 6, 9 and 12, each recording ``score``."""
    root = tmp_path_factory.mktemp("run")
    fit(root, monitor="score", mode="min")
    return root


def step_dir(root: Path, step: int) -> Path:
    return root / "ckpts" / f"step_{step:09d}"


# ----------------------------------------------------------------------------- load_from_checkpoint


def test_load_from_checkpoint_consolidates_a_checkpoint_directory(run) -> None:
    directory = step_dir(run, 9)
    model = Scored.load_from_checkpoint(directory)
    assert model.hparams.hidden == 16  # the module was rebuilt from the saved hyperparameters
    assert_weights(model, weights(directory))
    assert not torch.equal(model.net[0].weight, Scored(hidden=16).net[0].weight)


def test_consolidated_file_loads_like_a_lightning_checkpoint(run, tmp_path) -> None:
    out = tmp_path / "model.ckpt"
    state = consolidate(step_dir(run, 12), out)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"} <= set(state)
    assert state["global_step"] == 12 and len(state["optimizer_states"]) == 1
    assert_weights(Scored.load_from_checkpoint(out), state["state_dict"])
    assert torch.load(out, weights_only=True)["global_step"] == 12


def test_map_location_moves_the_consolidated_tensors(run) -> None:
    checkpoint = load_elastic_checkpoint(step_dir(run, 3), map_location="meta")
    assert {t.device.type for t in checkpoint["state_dict"].values()} == {"meta"}
    checkpoint = load_elastic_checkpoint(step_dir(run, 3), map_location={"cpu": "meta"})
    assert {t.device.type for t in checkpoint["state_dict"].values()} == {"meta"}
    kept = load_elastic_checkpoint(step_dir(run, 3), map_location=lambda storage, loc: storage)
    assert {t.device.type for t in kept["state_dict"].values()} == {"cpu"}


def test_a_checkpoint_root_is_refused_naming_its_newest_checkpoint(run) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"directory of 4 checkpoint.*step_000000012"):
        Scored.load_from_checkpoint(run / "ckpts")


def test_other_paths_still_load_as_lightning_loads_them(run, tmp_path) -> None:
    regular = tmp_path / "regular.ckpt"
    torch.save(consolidate(step_dir(run, 6)), regular)
    assert_weights(Scored.load_from_checkpoint(regular), weights(step_dir(run, 6)))
    with pytest.raises(IsADirectoryError):
        Scored.load_from_checkpoint(tmp_path)  # a directory that is none of ours
    with pytest.raises(FileNotFoundError):
        Scored.load_from_checkpoint(tmp_path / "missing.ckpt")


def test_the_loader_hooks_are_installed_once() -> None:
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_elastic.lightning.aliases import install_alias_parser
    from lightning_elastic.lightning.loading import install_checkpoint_loader

    before = (saving.pl_load, torch_io.pl_load, _CheckpointConnector._parse_ckpt_path)
    install_checkpoint_loader()
    install_alias_parser()
    after = (saving.pl_load, torch_io.pl_load, _CheckpointConnector._parse_ckpt_path)
    assert before == after and all(getattr(f, "__lightning_elastic_wrapped__", 0) for f in after)


# ----------------------------------------------------------------------------- ckpt_path=DIR


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
@pytest.mark.parametrize("ours", [True, False], ids=["with-callback", "plain-trainer"])
def test_evaluation_loads_a_checkpoint_directory(run, tmp_path, fn, ours) -> None:
    directory = step_dir(run, 6)
    if ours:  # the callback's resume hook loads it through the engine
        trainer = trainer_with(tmp_path)
    else:  # no callback, Lightning's own strategy: the TorchCheckpointIO loader consolidates
        trainer = make_trainer(str(tmp_path), max_steps=1, strategy="auto", devices=1)
    model = Scored(hidden=16)
    out = getattr(trainer, fn)(model, ckpt_path=str(directory))
    assert_weights(model, weights(directory))
    assert trainer.ckpt_path == str(directory)
    if fn == "predict":
        expected = Scored.load_from_checkpoint(directory).eval()
        x = IdDataset(8).x[:4]
        assert torch.equal(out[0], expected.net(x))


# ----------------------------------------------------------------------------- "last" / "best"


def test_fit_ckpt_path_last_continues_from_the_newest_checkpoint_in_a_fresh_trainer(
    tmp_path,
) -> None:
    fit(tmp_path, max_steps=6)
    trainer = trainer_with(tmp_path, max_steps=8, resume="never")  # "last" alone resumes
    model = Scored(hidden=16)
    trainer.fit(model, ckpt_path="last")
    assert trainer.ckpt_path.endswith("step_000000006")
    assert [step for step, _ in model.losses] == [6, 7]


def test_fit_ckpt_path_last_without_checkpoints_warns_and_starts_fresh(tmp_path) -> None:
    trainer = trainer_with(tmp_path, max_steps=2)
    model = Scored(hidden=16)
    with pytest.warns(UserWarning, match=r'fit\(ckpt_path="last"\).*holds no valid checkpoint'):
        trainer.fit(model, ckpt_path="last")
    assert [step for step, _ in model.losses] == [0, 1] and trainer.ckpt_path is None


def test_validate_ckpt_path_best_picks_the_best_scored_checkpoint(run) -> None:
    scores = {
        json.loads(p.read_text())["step"]: json.loads(p.read_text())["metrics"]["score"]
        for p in (run / "ckpts").glob("*/manifest.json")
    }
    best = min(scores, key=lambda step: scores[step])
    assert best == 6 and max(scores) == 12  # the best is not the newest
    trainer = trainer_with(run, monitor="score", mode="min")  # best_model_path is empty here
    model = Scored(hidden=16)
    trainer.validate(model, ckpt_path="best")
    assert trainer.ckpt_path.endswith("step_000000006")
    assert_weights(model, weights(step_dir(run, 6)))
    trainer = trainer_with(run, monitor="score", mode="max")
    trainer.test(model, ckpt_path="best")
    assert trainer.ckpt_path.endswith("step_000000012")


def test_best_in_the_same_process_after_fit(tmp_path) -> None:
    trainer, model = fit(tmp_path, monitor="score", mode="min")
    trainer.validate(model, ckpt_path="best")
    assert trainer.ckpt_path.endswith("step_000000006")
    assert_weights(model, weights(step_dir(tmp_path, 6)))


def test_best_walks_past_a_corrupt_best_checkpoint(run, tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run / "ckpts", copy / "ckpts")
    shard = next(step_dir(copy, 6).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    trainer = trainer_with(copy, monitor="score", mode="min")
    with pytest.warns(CorruptCheckpointWarning, match="step_000000006"):
        trainer.validate(Scored(hidden=16), ckpt_path="best")
    # scores 3: |2-6|=4, 9: |8-6|=2 -> step 9 is the next best
    assert trainer.ckpt_path.endswith("step_000000009")


def test_best_without_monitor_says_what_to_pass(run) -> None:
    trainer = trainer_with(run)
    with pytest.raises(ConfigError, match=r'ckpt_path="best".*DistributedCheckpoint\(monitor='):
        trainer.validate(Scored(hidden=16), ckpt_path="best")


def test_best_without_a_scored_checkpoint_says_what_to_log(run) -> None:
    trainer = trainer_with(run, monitor="accuracy", mode="max")
    with pytest.raises(CheckpointNotFoundError, match=r"recorded 'accuracy'.*self\.log"):
        trainer.validate(Scored(hidden=16), ckpt_path="best")


# ----------------------------------------------------------------------------- load_weights


class Finetuned(pl.LightningModule):
    """Scored's body under the same names, with a new head of 3 outputs."""

    def __init__(self) -> None:
        super().__init__()
        body = Scored(hidden=16).net
        body[3] = torch.nn.Linear(16, 3)
        self.net = body

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y.expand(-1, 3))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(16), batch_size=4)


def test_fine_tune_from_a_checkpoint_with_a_new_head(run, tmp_path) -> None:
    model = Finetuned()
    head = model.net[3].weight.detach().clone()
    report = load_weights(model, run / "ckpts", ignore_keys="net.3.*", strict=False)
    assert report.checkpoint.endswith("step_000000012")  # a root: its newest valid checkpoint
    assert report.ignored_keys == ("net.3.weight", "net.3.bias")
    assert report.missing_keys == () and report.unexpected_keys == ()
    saved = weights(step_dir(run, 12))
    assert torch.equal(model.net[0].weight, saved["net.0.weight"])
    assert torch.equal(model.net[3].weight, head)
    trainer = make_trainer(str(tmp_path), max_steps=2, strategy="auto", devices=1)
    trainer.fit(model)  # and it trains on
    assert trainer.global_step == 2 and not torch.equal(model.net[0].weight, saved["net.0.weight"])


def test_load_weights_strict_names_the_mismatching_key_and_shapes(run) -> None:
    with pytest.raises(WeightsMismatchError) as info:
        load_weights(Finetuned(), step_dir(run, 12))
    assert info.value.key == "net.3.weight"
    assert (info.value.checkpoint_shape, info.value.model_shape) == ((1, 16), (3, 16))


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_loads_in_one(tmp_path) -> None:
    final = run_distributed(loading_workers.fit_and_return_weights, 2, str(tmp_path), 6)[0]
    directory = step_dir(tmp_path, 6)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert_weights(TinyModule.load_from_checkpoint(directory), final)
    model = TinyModule(hidden=16)
    report = load_weights(model, tmp_path / "ckpts")
    assert report.step == 6 and report.missing_keys == () and report.unexpected_keys == ()
    assert_weights(model, final)
    state = consolidate(directory)
    assert state["global_step"] == 6 and len(state["optimizer_states"][0]["state"]) == 4
