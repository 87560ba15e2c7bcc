"""The epoch queue replica groups share (pure functions, no torchft): whatever the quorums, the
window lengths and the slots that contribute, an epoch trains every sample exactly once."""

from __future__ import annotations

import collections
import random

import pytest

from lightning_elastic.core.replicas.plan import (
    EpochQueue,
    QueuePlan,
    commit,
    commit_rounds,
    slot_samples,
    step_samples,
)


@pytest.mark.parametrize("seed", range(20))
def test_an_epoch_trains_every_sample_once_whatever_the_windows_and_contributions(
    seed: int,
) -> None:
    """Windows of 1-4 rounds planned as if each committed in full (as the strategy plans
    them), then committed with random slots missing (a peer whose heal failed), or not at
    all (a failed attempt): every sample is trained exactly once by the epoch's end."""
    rng = random.Random(seed)
    plan = QueuePlan(rng.randint(1, 60), seed=seed, shuffle=bool(seed % 2))
    queue = EpochQueue()
    trained: list[int] = []
    for _ in range(10_000):
        if queue.done(plan, 1):
            break
        slots = rng.randint(1, 6)
        size = rng.randint(1, 9)
        rounds, planned = [], queue
        for _ in range(rng.randint(1, 4)):
            samples = step_samples(plan, planned, size)
            rounds.append(samples)
            if samples:
                planned = commit(plan, planned, samples, slots, [True] * slots)
        if rng.random() < 0.2:
            continue  # the attempt failed: nothing recorded, the same samples come again
        contributed = [rng.random() < 0.7 for _ in range(slots)]
        for samples in rounds:
            for slot in range(slots):
                if contributed[slot]:
                    trained.extend(slot_samples(samples, slots, slot))
        queue = commit_rounds(plan, queue, rounds, slots, contributed)
        assert queue.samples == len(trained)
    counts = collections.Counter(trained)
    assert sorted(counts) == list(range(plan.length)) and set(counts.values()) == {1}
