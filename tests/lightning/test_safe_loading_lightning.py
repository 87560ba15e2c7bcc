"""A Lightning run with the state users really have (Lightning's own callbacks, a plateau
scheduler, a torchmetrics metric, omegaconf hparams, numpy RNG) resumes bitwise while every
object is loaded safely (``weights_only=True`` and the allowlist): nothing needs ``trusted``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lightning_elastic import DistributedCheckpoint
from lightning_elastic.core.load import load as load_module
from tests.lightning.models import TinyModule, make_trainer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

# 64 samples, batch 4, 1 device: 16 steps per epoch. Resuming at 20 (mid-epoch, after the first
# epoch end stepped the plateau scheduler and set EarlyStopping's best score) and stopping before
# the next epoch end: Lightning skips the epoch-end plateau step of an epoch resumed in when
# training by max_steps (its own rule, `FitLoop.restarting`), which would fork the runs there.
MAX_STEPS = 30
RESUME_AT = 20


class PlateauModule(TinyModule):
    """TinyModule configured by an omegaconf DictConfig, with AdamW + ReduceLROnPlateau and an
    epoch-level torchmetrics metric for EarlyStopping / ModelCheckpoint to monitor."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(lr=cfg.lr, batch_size=cfg.batch_size)
        self.save_hyperparameters(cfg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        self.log("train_mae", self.train_mae, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "epoch"},
        }


def _config() -> DictConfig:
    return OmegaConf.create(
        {
            # what TinyModule reads from its hparams
            **{"n": 64, "batch_size": 4, "lr": 0.01, "kill_at": -1, "signal_at": -1},
            **{"signal_rank": 0, "step_sleep": 0.0},
            "model": {"hidden": [32, 16], "act": "relu"},  # a ListConfig: pickled whole
            "tags": ["safe", "resume"],
        }
    )


class StateAt(pl.Callback):
    """Records the scheduler's and EarlyStopping's state when ``step`` starts (in a resumed
    run: right after they were restored)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            early = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
            best = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint))
            self.state = {
                "best_score": best.best_model_score,
                "plateau": dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "early": dict(early.state_dict()),
            }


def _fit(root: str, max_steps: int, **cb: Any) -> dict[str, Any]:
    pl.seed_everything(7, verbose=False)
    model = PlateauModule(_config())
    early = EarlyStopping(monitor="train_loss", patience=5)
    best = ModelCheckpoint(dirpath=f"{root}/best", monitor="train_loss", save_top_k=1)
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=5, **cb)
    at_resume = StateAt(RESUME_AT)
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy="auto",
        devices=1,
        callbacks=[checkpoint, early, best, at_resume],
    )
    trainer.fit(model)
    return {
        "losses": model.losses,
        "seen": model.seen,
        "resumed_from": trainer.ckpt_path,
        "at_resume": at_resume.state,
    }


def test_lightning_state_resumes_bitwise_under_safe_loading(tmp_path, monkeypatch) -> None:
    reference = _fit(str(tmp_path / "ref"), MAX_STEPS)
    _fit(str(tmp_path / "run"), RESUME_AT + 2, save_on_train_end=False)

    loaded: list[tuple[str, bool]] = []
    original = load_module.load_object

    def recording(value: Any, fqn: str, *, trusted: bool = False) -> Any:
        loaded.append((fqn, trusted))
        return original(value, fqn, trusted=trusted)

    monkeypatch.setattr(load_module, "load_object", recording)
    resumed = _fit(str(tmp_path / "run"), MAX_STEPS)

    assert resumed["resumed_from"].endswith(f"step_{RESUME_AT:09d}")
    names = {fqn for fqn, _ in loaded}
    assert not any(trusted for _, trusted in loaded)
    # objects that need the allowlist were among them: omegaconf, numpy's RNG state
    assert {"hparams_type", "hyper_parameters.model.hidden", "hyper_parameters.tags"} <= names
    assert "__rank_local__.0.rng.numpy" in names
    assert any(name.startswith("lr_schedulers.0.") for name in names)
    assert any(name.startswith("callbacks.EarlyStopping") for name in names)

    ref = dict(reference["losses"])
    got = dict(resumed["losses"])
    assert sorted(got) == list(range(RESUME_AT, MAX_STEPS))
    assert all(ref[s] == got[s] for s in got), "losses differ after a safe resume"
    assert [s for s in reference["seen"] if s[0] >= RESUME_AT] == resumed["seen"]
    # the scheduler and EarlyStopping were restored as saved, not just re-created
    at_resume = reference["at_resume"]
    assert at_resume["plateau"]["last_epoch"] == 1 and at_resume["plateau"]["best"] < 1e9
    assert at_resume["early"]["best_score"] < 1e9
    assert resumed["at_resume"]["plateau"] == at_resume["plateau"]
    assert resumed["at_resume"]["lr"] == at_resume["lr"]
    assert str(resumed["at_resume"]["early"]) == str(at_resume["early"])
    assert torch.equal(resumed["at_resume"]["best_score"], at_resume["best_score"])
    # (their final states are not compared: the epoch-level `train_loss` they monitor at the
    # last, partial epoch covers only the steps after the resume; Lightning does not save it)


class Opaque:
    """A user type outside the allowlist, saved by a module's ``on_save_checkpoint``."""

    def __init__(self, value: int) -> None:
        self.value = value


class OpaqueModule(TinyModule):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["opaque"] = Opaque(self.global_step)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.restored = checkpoint["opaque"].value


def _fit_opaque(root: str, max_steps: int, strategy: Any = "auto", **cb: Any) -> OpaqueModule:
    pl.seed_everything(7, verbose=False)
    model = OpaqueModule(n=32, batch_size=4)
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=2, **cb)
    trainer = make_trainer(
        root, max_steps=max_steps, strategy=strategy, devices=1, callbacks=[checkpoint]
    )
    trainer.fit(model)
    return model


def test_a_user_type_is_refused_unless_the_strategy_trusts_the_checkpoint(tmp_path) -> None:
    from lightning_elastic import ElasticDeprecationWarning, ElasticStrategy, UnsafeCheckpointError

    _fit_opaque(str(tmp_path), 2)
    with pytest.raises(UnsafeCheckpointError, match=r"Opaque.*trusted=True"):
        _fit_opaque(str(tmp_path), 4)
    assert [p.name for p in sorted((tmp_path / "ckpts").glob("step_*"))] == ["step_000000002"]
    # the callback's old spelling still works (with Lightning's own strategy too) ...
    with pytest.warns(ElasticDeprecationWarning, match=r"ElasticStrategy\(trusted="):
        model = _fit_opaque(str(tmp_path), 4, trusted=True)
    assert model.restored == 2
    # ... the strategy's is the one to set
    model = _fit_opaque(str(tmp_path), 6, strategy=ElasticStrategy(trusted=True))
    assert model.restored == 4
