"""Every option of DistributedCheckpoint has one home: the common ones flat, the advanced ones
in typed groups (cadence, tiers, monitoring, retention) that also work from a LightningCLI
YAML, the trainer-wide ones on the strategy; the old spellings still work with a warning that
names the new one, and never is one of two values silently ignored (docs/options.md)."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_elastic import (
    CadenceOptions,
    DistributedCheckpoint,
    ElasticDeprecationWarning,
    ElasticStrategy,
    KeepBestK,
    KeepEveryNSteps,
    KeepLastN,
    MonitoringOptions,
    TierOptions,
)
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning.checkpoint_options import MOVED, session_options
from lightning_elastic.lightning.session import ElasticSession

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# ----------------------------------------------------------------------------- the groups


def test_the_groups_are_frozen_and_checked_when_built() -> None:
    tiers = TierOptions(Path("/dev/shm/ckpt"), persist_every_n_saves=4)
    assert tiers.local_dirpath == "/dev/shm/ckpt"  # a Path is kept as a string
    assert tiers.engine_options() == {
        "local_root": "/dev/shm/ckpt",
        "persist_every_n_saves": 4,
        "replicas": 1,
        "local_keep": 2,
        "node": None,
    }
    for group in (tiers, MonitoringOptions(), CadenceOptions()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            group.history = False  # type: ignore[misc, union-attr]
    with pytest.raises(ConfigError, match="straggler_factor must be None or a number > 1"):
        MonitoringOptions(straggler_factor=1.0)
    with pytest.raises(ConfigError, match="history must be True or False"):
        MonitoringOptions(history="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"straggler_window must be an integer"):
        MonitoringOptions(straggler_window=2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tiers": {"local_dirpath": "/dev/shm/x"}}, r"tiers must be a TierOptions\(\.\.\.\)"),
        ({"monitoring": {"metrics_port": 0}}, r"monitoring must be a MonitoringOptions"),
        ({"cadence": {"mtbf": "4h"}}, r"cadence must be a CadenceOptions"),
        ({"retention": KeepLastN(2)}, "retention must be a list of policies"),
        ({"retention": [KeepLastN]}, "is not a retention policy"),
        ({"retention": ["keep_last_n"]}, "is not a retention policy"),
        (
            {"cadence": CadenceOptions(mtbf="4h")},
            'mtbf is used only with train_time_interval="auto"',
        ),
    ],
)
def test_a_group_that_is_not_its_type_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DistributedCheckpoint("/tmp/x", **kwargs)


def test_the_groups_reach_the_callback() -> None:
    cb = DistributedCheckpoint(
        "/tmp/x",
        train_time_interval="auto",
        cadence=CadenceOptions(mtbf="4h", max_overhead=0.02),
        tiers=TierOptions("/dev/shm/x", replicas=2),
        monitoring=MonitoringOptions(straggler_factor=None, history=False),
    )
    assert cb._schedule.cadence.auto == {"mtbf_s": 4 * 3600.0, "max_overhead": 0.02}
    assert cb.tiers is not None and cb.tiers.replicas == 2
    assert cb.monitoring.straggler_factor is None and not cb.monitoring.history
    assert DistributedCheckpoint().monitoring == MonitoringOptions()  # the default


# ----------------------------------------------------------------------------- retention


def test_retention_takes_the_exported_policies_beside_the_flat_ones() -> None:
    cb = DistributedCheckpoint(
        "/tmp/x",
        keep_last_n=3,
        monitor="val_loss",
        keep_best_k=2,
        retention=[KeepEveryNSteps(1000), KeepBestK(1, "val_acc", "max")],
    )
    assert set(cb.retention) == {
        KeepLastN(3),
        KeepBestK(2, "val_loss", "min"),
        KeepEveryNSteps(1000),
        KeepBestK(1, "val_acc", "max"),
    }
    # every KeepBestK's metric is recorded with each checkpoint, the monitor's first
    assert cb._recorded == ("val_loss", "val_acc")
    assert DistributedCheckpoint("/tmp/x").retention == ()  # no rule: keep everything


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last_n": 3, "retention": [KeepLastN(5)]},
        {"monitor": "loss", "keep_best_k": 2, "retention": [KeepBestK(4, "loss")]},
    ],
)
def test_a_rule_given_flat_and_in_retention_is_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="same rule given twice"):
        DistributedCheckpoint("/tmp/x", **kwargs)


def test_a_best_k_on_another_metric_is_another_rule() -> None:
    cb = DistributedCheckpoint(
        "/tmp/x", monitor="loss", keep_best_k=2, retention=[KeepBestK(1, "acc", "max")]
    )
    assert len(cb.retention) == 2


class LossAt(pl.Callback):
    """The logged ``train_loss`` at the end of every optimizer step."""

    def __init__(self) -> None:
        self.loss: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.loss[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def test_the_metric_of_a_best_k_rule_is_recorded_and_ranks_the_checkpoints(tmp_path) -> None:
    """retention=[KeepBestK(2, "train_loss")] without ``monitor``: every checkpoint records the
    metric, and retention keeps the two best of them and the newest."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from lightning_cli import DemoData, DemoModel
    finally:
        sys.path.remove(str(EXAMPLES))
    pl.seed_everything(7, verbose=False)
    checkpoint = DistributedCheckpoint(
        tmp_path / "ckpts",
        every_n_train_steps=2,
        async_save=False,
        retention=[KeepBestK(2, "train_loss")],
    )
    losses = LossAt()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        callbacks=[losses, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(DemoModel(lr=0.05), datamodule=DemoData(n=64))
    manifests = sorted((tmp_path / "ckpts").glob("step_*/manifest.json"))
    recorded = {
        int(p.parent.name.split("_")[1]): json.loads(p.read_text())["metrics"] for p in manifests
    }
    for step, metrics in recorded.items():
        assert metrics == {"train_loss": pytest.approx(losses.loss[step])}, step
    saved = {step: losses.loss[step] for step in range(2, 13, 2)}
    best_two = sorted(saved, key=lambda step: saved[step])[:2]
    assert set(recorded) == {*best_two, 12}


def test_a_best_k_metric_nobody_logs_is_a_config_error(tmp_path) -> None:
    from tests.lightning.models import TinyModule, make_trainer

    checkpoint = DistributedCheckpoint(
        tmp_path / "ckpts", every_n_train_steps=2, retention=[KeepBestK(2, "val_acc", "max")]
    )
    trainer = make_trainer(
        str(tmp_path), max_steps=4, strategy="auto", devices=1, callbacks=[checkpoint]
    )
    with pytest.raises(ConfigError, match=r"retention=\[KeepBestK\(monitor='val_acc'\)\]"):
        trainer.fit(TinyModule())


# ----------------------------------------------------------------------------- old spellings

OLD_VALUES: dict[str, Any] = {
    "storage_options": {"anon": True},
    "verify": "size",
    "timeout": 30,
    "trusted": True,
    "mtbf": "4h",
    "max_overhead": 0.02,
    "min_interval": 5,
    "metrics_port": 0,
    "straggler_factor": None,
    "straggler_window": 10,
    "history": False,
    "local_dirpath": "/dev/shm/x",
    "persist_every_n_saves": 3,
    "replicas": 2,
    "local_keep": 4,
    "node": "n1",
    "keep_every_n_steps": 100,
}
# what a group field needs beside it (its mode, local_dirpath)
NEEDS: dict[str, dict[str, Any]] = {
    "mtbf": {"train_time_interval": "auto"},
    "max_overhead": {"train_time_interval": "auto"},
    "min_interval": {"train_time_interval": "continuous"},
    **{
        name: {"local_dirpath": "/dev/shm/x"}
        for name in ("persist_every_n_saves", "replicas", "local_keep", "node")
    },
}


def _where_it_went(cb: DistributedCheckpoint, old: str) -> Any:
    for group in ("cadence", "monitoring", "tiers"):
        value = getattr(cb, group)
        if value is not None and old in {f.name for f in dataclasses.fields(value)}:
            return getattr(value, old)
    if old == "keep_every_n_steps":
        return cb.retention[0].n
    return cb._strategy_options[old]


def test_every_old_spelling_is_listed() -> None:
    assert set(OLD_VALUES) == set(MOVED)


@pytest.mark.parametrize("old", sorted(OLD_VALUES))
def test_every_old_spelling_still_works_with_a_warning_naming_the_new_one(old: str) -> None:
    value = OLD_VALUES[old]
    with pytest.warns(ElasticDeprecationWarning) as warned:
        cb = DistributedCheckpoint("/tmp/x", **{old: value, **NEEDS.get(old, {})})
    messages = [str(w.message) for w in warned]
    assert f"DistributedCheckpoint({old}=...) is deprecated: use {MOVED[old]}" in messages
    assert all(w.filename == __file__ for w in warned)  # the line that built the callback
    assert _where_it_went(cb, old) == value


def test_an_old_spelling_given_with_its_new_home_is_refused() -> None:
    with (
        pytest.warns(ElasticDeprecationWarning),
        pytest.raises(ConfigError, match=r"mtbf and cadence=CadenceOptions\(\.\.\.\) both given"),
    ):
        DistributedCheckpoint(train_time_interval="auto", mtbf="4h", cadence=CadenceOptions())
    with (
        pytest.warns(ElasticDeprecationWarning),
        pytest.raises(ConfigError, match="same rule given twice"),
    ):
        DistributedCheckpoint(keep_every_n_steps=5, retention=[KeepEveryNSteps(10)])


def test_an_unknown_keyword_is_a_type_error_as_in_python() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'every_n_steps'"):
        DistributedCheckpoint(every_n_steps=5)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------- the strategy's


def _strategy(**options: Any) -> Any:
    defaults = {"checkpoint_timeout": None, "verify": "full", "trusted": False}
    return SimpleNamespace(**{**defaults, "storage_options": {}, **options})


def test_the_strategy_options_come_from_the_strategy() -> None:
    got = session_options(
        _strategy(checkpoint_timeout=42, verify="size", trusted=True, storage_options={"a": 1}),
        {},
    )
    assert got.timeout == timedelta(seconds=42) and got.verify == "size" and got.trusted
    assert got.storage_options == {"a": 1}
    # Lightning's own strategies have none of them: the defaults
    plain = session_options(object(), {})
    assert (plain.timeout, plain.verify, plain.trusted, plain.storage_options) == (
        timedelta(minutes=10),
        "full",
        False,
        {},
    )


def test_the_callbacks_old_spelling_applies_unless_the_strategy_says_otherwise() -> None:
    given = {"verify": "none", "storage_options": {"b": 2}, "trusted": True, "timeout": 20}
    got = session_options(_strategy(), given)
    assert (got.verify, got.storage_options, got.trusted) == ("none", {"b": 2}, True)
    assert got.timeout == timedelta(seconds=20)
    same = session_options(_strategy(verify="none", storage_options={"b": 2}), given)
    assert (same.verify, same.storage_options) == ("none", {"b": 2})
    with pytest.raises(ConfigError, match=r"ElasticStrategy|verify='size'"):
        session_options(_strategy(verify="size"), {"verify": "none"})
    with pytest.raises(ConfigError, match="two different storage_options"):
        session_options(_strategy(storage_options={"a": 1}), {"storage_options": {"b": 2}})
    with pytest.raises(ConfigError, match="two different checkpoint timeouts"):
        session_options(_strategy(checkpoint_timeout=10), {"timeout": 20})


def test_the_strategys_verify_is_the_one_a_resume_uses(tmp_path, monkeypatch) -> None:
    """Before: a callback's default verify="full" silently won over ElasticStrategy(verify=)."""
    from tests.lightning.models import TinyModule, make_trainer

    used: list[str] = []
    original = ElasticSession.load

    def load(self: ElasticSession, engine: Any, *, name: str | None, verify: str) -> Any:
        used.append(verify)
        return original(self, engine, name=name, verify=verify)

    monkeypatch.setattr(ElasticSession, "load", load)
    for max_steps in (4, 6):
        checkpoint = DistributedCheckpoint(tmp_path / "ckpts", every_n_train_steps=2)
        trainer = make_trainer(
            str(tmp_path),
            max_steps=max_steps,
            strategy=ElasticStrategy(verify="size"),
            devices=1,
            callbacks=[checkpoint],
        )
        trainer.fit(TinyModule())
    assert used == ["size", "size"]  # the fresh start found nothing, the second resumed
    assert checkpoint.resume_cost is not None


def test_signals_on_the_callback_are_refused_under_elastic_ft_unless_they_are_the_drain() -> None:
    drain = (int(signal.SIGUSR2),)
    ft = SimpleNamespace(drain_signals=drain)
    DistributedCheckpoint()._check_drain_signals(ft)  # the default: nothing was asked
    DistributedCheckpoint(signals="SIGUSR2")._check_drain_signals(ft)  # the same: fine
    with pytest.raises(ConfigError, match=r"ElasticFTStrategy\(drain_signals=\.\.\.\)"):
        DistributedCheckpoint(signals="SIGHUP")._check_drain_signals(ft)


# ----------------------------------------------------------------------------- LightningCLI

EVERY_GROUP = """
seed_everything: 7
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 8
  default_root_dir: {root}
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: lightning_elastic.ElasticStrategy
    init_args:
      checkpoint_timeout: "0:05:00"
      verify: size
      storage_options: {{}}
      trusted: false
  callbacks:
    - class_path: lightning_elastic.DistributedCheckpoint
      init_args:
        dirpath: ${{trainer.default_root_dir}}/checkpoints
        every_n_train_steps: 2
        train_time_interval: auto
        monitor: train_loss
        keep_last_n: 2
        keep_best_k: 1
        retention:
          - class_path: lightning_elastic.KeepEveryNSteps
            init_args:
              n: 4
        cadence:
          mtbf: 4h
          max_overhead: 0.05
        tiers:
          local_dirpath: {root}/local
          persist_every_n_saves: 2
          local_keep: 3
        monitoring:
          straggler_factor: 3.0
          straggler_window: 4
          history: true
data:
  n: 64
"""


def _cli(config: Path | None, *args: str, run: bool = True) -> Any:
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, str(EXAMPLES))
    try:
        from lightning_cli import DemoData, DemoModel
    finally:
        sys.path.remove(str(EXAMPLES))
    return LightningCLI(
        DemoModel,
        DemoData,
        args=[*args, *([] if config is None else ["--config", str(config)])],
        run=run,
        save_config_callback=None,
        parser_kwargs={"parser_mode": "omegaconf"},
    )


def _callback(cli: Any) -> DistributedCheckpoint:
    (checkpoint,) = [c for c in cli.trainer.callbacks if isinstance(c, DistributedCheckpoint)]
    return checkpoint


def test_a_lightning_cli_yaml_with_every_group_builds_and_fits(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning_cli.py"])  # LightningCLI warns about others
    config = tmp_path / "config.yaml"
    config.write_text(EVERY_GROUP.format(root=tmp_path))
    cli = _cli(config, "fit")
    checkpoint = _callback(cli)
    assert checkpoint.dirpath == f"{tmp_path}/checkpoints"
    assert checkpoint.cadence == CadenceOptions(mtbf="4h", max_overhead=0.05)
    assert checkpoint.tiers == TierOptions(
        f"{tmp_path}/local", persist_every_n_saves=2, local_keep=3
    )
    assert checkpoint.monitoring == MonitoringOptions(straggler_factor=3.0, straggler_window=4)
    assert set(checkpoint.retention) == {
        KeepEveryNSteps(4),
        KeepLastN(2),
        KeepBestK(1, "train_loss", "min"),
    }
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ElasticStrategy)
    assert strategy.checkpoint_timeout == timedelta(minutes=5) and strategy.verify == "size"
    # and it trains: the tiers, the retention rules and the history at work
    local = sorted(p.name for p in (tmp_path / "local").glob("step_*"))
    persisted = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert cli.trainer.global_step == 8
    assert local == ["step_000000004", "step_000000006", "step_000000008"]  # local_keep=3
    assert "step_000000008" in persisted and "step_000000002" not in persisted
    assert (tmp_path / "checkpoints" / "_history").is_dir()


def test_the_old_spellings_still_work_from_a_yaml(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning_cli.py"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "seed_everything: 7\n"
        "trainer:\n"
        "  logger: false\n"
        "  callbacks:\n"
        "    - class_path: lightning_elastic.DistributedCheckpoint\n"
        "      init_args:\n"
        "        train_time_interval: auto\n"
        "        mtbf: 4h\n"
        "        local_dirpath: /dev/shm/never-written\n"
        "        straggler_factor: null\n"
        "        keep_every_n_steps: 100\n"
    )
    with pytest.warns(ElasticDeprecationWarning) as warned:
        checkpoint = _callback(_cli(config, run=False))
    assert len(warned) == 4
    assert checkpoint.cadence == CadenceOptions(mtbf="4h")
    assert checkpoint.tiers == TierOptions("/dev/shm/never-written")
    assert checkpoint.monitoring.straggler_factor is None
    assert checkpoint.retention == (KeepEveryNSteps(100),)


def test_lightning_cli_help_shows_the_groups_and_marks_the_old_spellings(
    monkeypatch, capsys
) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning_cli.py"])
    with pytest.raises(SystemExit) as exited:
        _cli(None, "fit", "--trainer.callbacks.help", "lightning_elastic.DistributedCheckpoint")
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for group in ("CadenceOptions", "TierOptions", "MonitoringOptions", "RetentionPolicy"):
        assert group in shown, group
    assert "deprecated: ``tiers=TierOptions(local_dirpath=...)``" in shown
