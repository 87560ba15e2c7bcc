"""Every sample once per epoch while the quorum changes, in this process: one real replica
group whose quorum is scripted to hold other (virtual) groups, step by step: 1, 2 or 3
groups, this group first, second or third, a step that fails and is redone under another
quorum, a peer whose heal failed (it takes part without counting: its samples go back to the
queue). Each committed step's samples are every contributing slot's share; across the run
each epoch trains every sample exactly once (with ``drop_last``: at most once, less than a
global batch left out), and every batch this process trains is exactly its share of the
window, also when the DataLoader's workers prefetched a wrong prediction."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.replicas.harness import solo_group

pytestmark = pytest.mark.timeout(300)

SAMPLES = 37  # not a multiple of any global batch below: uneven tails


class Numbered(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.tensor(index), torch.randn(3, generator=generator)


class Model(pl.LightningModule):
    def __init__(self, loader: dict[str, Any]) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)
        self.loader = loader
        self.windows: list[tuple[Any, int]] = []  # per training_step: the window, its index
        self.mismatches: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x = batch
        window = self.trainer.strategy._window
        index = self.windows[-1][1] + 1 if self.windows and self.windows[-1][0] is window else 0
        self.windows.append((window, index))
        if ids.tolist() != list(window.mine[index]):  # the batch is not this slot's share
            self.mismatches.append(f"{ids.tolist()} != {window.mine[index]}")
        return self.net(x).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Numbered(), shuffle=True, **self.loader)


@dataclasses.dataclass
class Script:
    """The quorum of each attempt (participants, this group's place), the reduce calls that
    fail (a peer died in the step) and those where one peer's heal failed."""

    quorums: list[tuple[int, int]]
    fail: set[int] = dataclasses.field(default_factory=set)
    peer_heal_failed: set[int] = dataclasses.field(default_factory=set)


def _fit(
    monkeypatch: pytest.MonkeyPatch, script: Script, loader: dict[str, Any], **trainer: Any
) -> tuple[Model, dict[int, list[int]], int]:
    from lightning_elastic import ElasticFTStrategy
    from lightning_elastic.core.replicas.group import ReplicaGroup
    from lightning_elastic.core.replicas.plan import slot_samples
    from lightning_elastic.lightning.replica_data import ReplicaData

    calls = {"start": 0, "reduce": 0}
    trained: dict[int, list[int]] = collections.defaultdict(list)
    start_step, reduce, commit = ReplicaGroup.start_step, ReplicaGroup.reduce, ReplicaData.commit

    def scripted_start(self: ReplicaGroup) -> Any:
        view = start_step(self)
        participants, place = script.quorums[calls["start"] % len(script.quorums)]
        calls["start"] += 1
        return dataclasses.replace(view, participants=participants, participant=place)

    def scripted_reduce(self: ReplicaGroup, grads: Any, *, view: Any, **kwargs: Any) -> Any:
        calls["reduce"] += 1
        if calls["reduce"] in script.fail:
            self.manager.report_error(RuntimeError("a peer died during the step"))
            return None
        result = reduce(self, grads, view=view, **kwargs)
        if result is None:
            return None
        # the virtual peers' slots contributed (but one whose heal failed, when scripted)
        contributed = [True] * view.slots
        if calls["reduce"] in script.peer_heal_failed and view.participants > 1:
            contributed[(view.participant + 1) % view.participants] = False
        return dataclasses.replace(result, contributed=contributed)

    def recording_commit(self: ReplicaData, contributed: Any) -> None:
        slots = len(contributed)
        for samples in self.window.rounds:
            for slot in range(slots):
                if contributed[slot]:
                    trained[self.queue.epoch].extend(slot_samples(samples, slots, slot))
        commit(self, contributed)

    monkeypatch.setattr(ReplicaGroup, "start_step", scripted_start)
    monkeypatch.setattr(ReplicaGroup, "reduce", scripted_reduce)
    monkeypatch.setattr(ReplicaData, "commit", recording_commit)
    with solo_group(monkeypatch):
        pl.seed_everything(3)
        model = Model(loader)
        fit = pl.Trainer(
            strategy=ElasticFTStrategy(step_timeout=5, quorum_timeout=30, **trainer.pop("ft", {})),
            accelerator="cpu",
            devices=1,
            max_epochs=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer,
        )
        fit.fit(model)
    assert calls["reduce"] > max(script.fail | script.peer_heal_failed, default=0)
    return model, trained, fit.global_step


CHANGING = [(1, 0), (2, 0), (2, 1), (3, 2), (3, 0), (2, 1), (1, 0), (3, 1)]


@pytest.mark.parametrize(
    ("script", "loader", "trainer"),
    [
        (Script(CHANGING, fail={3, 9, 15}, peer_heal_failed={5, 6, 14}), {"batch_size": 4}, {}),
        (
            Script(CHANGING[::-1], fail={2, 11}, peer_heal_failed={4}),
            {"batch_size": 3, "num_workers": 2},
            {},
        ),
        (
            Script(CHANGING, fail={4, 7}, peer_heal_failed={2, 9}),
            {"batch_size": 2},
            {"accumulate_grad_batches": 3, "ft": {"global_batch_size": 5}},
        ),
    ],
    ids=["per-rank-batch", "workers-prefetch", "global-batch-accumulate"],
)
def test_every_sample_is_trained_once_per_epoch_whatever_the_quorum_does(
    monkeypatch: pytest.MonkeyPatch, script: Script, loader: dict[str, Any], trainer: Any
) -> None:
    model, trained, _ = _fit(monkeypatch, script, loader, **trainer)
    assert not model.mismatches, model.mismatches[:5]
    assert sorted(trained) == [0, 1, 2]
    for epoch, samples in trained.items():
        twice = sorted(i for i, n in collections.Counter(samples).items() if n > 1)
        assert not twice and sorted(samples) == list(range(SAMPLES)), (epoch, twice)


def test_drop_last_leaves_out_less_than_a_global_batch_and_trains_nothing_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = Script(CHANGING, fail={5}, peer_heal_failed={3, 8})
    model, trained, _ = _fit(monkeypatch, script, {"batch_size": 4, "drop_last": True})
    assert not model.mismatches, model.mismatches[:5]
    for epoch in (0, 1, 2):
        counts = collections.Counter(trained[epoch])
        assert max(counts.values()) == 1, epoch
        assert SAMPLES - len(counts) < 4 * 3, (epoch, SAMPLES - len(counts))  # < the largest


def test_max_steps_stops_every_group_at_the_same_committed_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Failed attempts are not steps: max_steps counts committed ones."""
    script = Script(CHANGING, fail={2, 3, 6})
    _, trained, step = _fit(monkeypatch, script, {"batch_size": 4}, max_steps=7)
    assert step == 7
    assert len(set(trained[0])) == len(trained[0])
