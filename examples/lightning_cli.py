"""LightningCLI with ElasticStrategy and DistributedCheckpoint, configured in YAML.

    python examples/lightning_cli.py fit --config examples/config.yaml

Run it, interrupt it (Ctrl-C, a SIGTERM, a lost node, or ``--model.kill_at_step 25`` to
simulate a crash), run the same command again: it resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

import lightning_elastic  # noqa: F401  (registers strategy="elastic")


class Regression(Dataset):
    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, 1, generator=g)).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class DemoData(pl.LightningDataModule):
    def __init__(self, n: int = 512, dim: int = 16, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        data = Regression(self.hparams.n, self.hparams.dim)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True)


class DemoModel(pl.LightningModule):
    def __init__(
        self, dim: int = 16, hidden: int = 64, lr: float = 0.01, kill_at_step: int | None = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(hidden, 1),
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        if self.global_step == self.hparams.kill_at_step:
            print(
                f"[rank {self.global_rank}] simulated crash at step {self.global_step}", flush=True
            )
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        if self.global_rank == 0 and self.global_step % 10 == 0:
            print(f"step {self.global_step:3d}  loss {loss.item():.4f}", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    LightningCLI(
        DemoModel,
        DemoData,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
