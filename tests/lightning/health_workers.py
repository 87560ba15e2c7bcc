"""Rank functions for the observability tests: a rank made slow on purpose, the trainer's
loggers, the metrics endpoint scraped from inside the run."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_elastic import DistributedCheckpoint, ElasticStrategy, HealthMonitor
from lightning_elastic.core.policy.cadence import Cadence
from tests.lightning.models import TinyModule


class SlowRank(TinyModule):
    """Sleeps on one rank after the step's loss all-reduce: a slow forward, as a throttled
    device or a slow data node would give."""

    def __init__(
        self, *, slow_rank: int = -1, slow_s: float = 0.0, raise_at: int = -1, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.slow_rank, self.slow_s, self.raise_at = slow_rank, slow_s, raise_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == self.hparams.kill_at:
            # the progress records of the steps before are written (in the background) before
            # the kill, as they would be on a machine that is not loaded by a whole test suite
            checkpoint = next(c for c in self.trainer.callbacks if hasattr(c, "health"))
            checkpoint.health.flush(timeout=60)
        if self.global_step == self.raise_at:
            raise RuntimeError(f"simulated out-of-memory at step {self.global_step}")
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.slow_rank:
            time.sleep(self.slow_s)
        return loss


class Scrape(pl.Callback):
    """Reads this rank's /metrics at the end of training (the endpoint closes at teardown)."""

    def __init__(self, checkpoint: DistributedCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.text = ""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        monitor = self.checkpoint.health
        assert monitor is not None and monitor.port is not None
        url = f"http://127.0.0.1:{monitor.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            self.text = reply.read().decode()


def fit_observed(
    root: str,
    max_steps: int,
    *,
    kill_at: int = -1,
    slow_rank: int = -1,
    slow_s: float = 0.0,
    step_sleep: float = 0.0,
    loggers: bool = False,
    scrape: bool = False,
    auto_initial_s: float | None = None,
    devices: int | None = None,
    raise_at: int = -1,
    progress_every_s: float | None = 0.0,
    **cb: Any,
) -> dict[str, Any]:
    HealthMonitor.progress_every_s = progress_every_s
    if auto_initial_s is not None:
        Cadence.AUTO_INITIAL_S = auto_initial_s
    pl.seed_everything(7, verbose=False)
    model = SlowRank(
        slow_rank=slow_rank,
        slow_s=slow_s,
        raise_at=raise_at,
        kill_at=kill_at,
        step_sleep=step_sleep,
    )
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", **cb)
    scraper = Scrape(checkpoint)
    logger: Any = False
    if loggers:
        logger = [
            CSVLogger(root, name="csv", version=0),
            TensorBoardLogger(root, name="tb", version=0),
        ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if devices is None else devices,
        strategy=ElasticStrategy(),
        max_steps=max_steps,
        default_root_dir=root,
        callbacks=[checkpoint, *([scraper] if scrape else [])],
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model)
    except RuntimeError as exc:
        if "simulated out-of-memory" not in str(exc):
            raise
    monitor = checkpoint.health
    assert monitor is not None
    return {
        "metrics": monitor.health.snapshot(),
        "stragglers": [vars(s) for s in monitor.stragglers],
        "hosts": monitor.hosts,
        "scraped": scraper.text,
        "interval_s": None if monitor.cadence is None else monitor.cadence.interval_s,
        "losses": model.losses,
    }
