"""LitData's StreamingDataset / StreamingDataLoader resumed through our checkpoints: exact at the
same world size across epoch boundaries (0 and 2 loader workers, drop_last both ways), epochs
where an uninterrupted run at the new size puts them after 2 -> 3 -> 2 -> 1 ranks, every
sample once per epoch except what LitData's elastic resume repeats (and a warning says so), and
a dataset built before the process group fixed or refused (a validation one too). Hostile
cases: ``limit_train_batches`` cutting LitData's pass, a ``CombinedStreamingDataset`` (same
topology exact, another one started over with a warning), hand-edited or foreign loader
states, a torch ``DataLoader`` over LitData, ``global_batch_size``, model parallelism.

One dataset of 96 samples in 8 chunks and one of 24 (``litdata.optimize``, once per module);
one launch at 2 ranks runs the same-world fits and starts the chain that 3, 2 and 1 ranks
continue; the hostile fits run in this process, at one rank."""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import warnings
from typing import Any

import pytest
import torch

from lightning_elastic import DistributedCheckpoint
from lightning_elastic.errors import ConfigError, DataShardingError, WorldSizeError
from lightning_elastic.testing.spawn import run_distributed
from tests.elastic import journal
from tests.lightning import litdata_workers as w
from tests.lightning.models import make_trainer

litdata = pytest.importorskip("litdata")

from lightning_elastic.lightning import (  # noqa: E402
    litdata_loaders,
    litdata_plan,
    litdata_ranks,
)

pytestmark = pytest.mark.timeout(400)
EPOCHS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return w.write(tmp_path_factory.mktemp("litdata") / "data")


# ---------------------------------------------------------------------- in one process


def loader_at(monkeypatch, data, world, rank, workers, batch, drop_last=True):
    """A StreamingDataLoader as rank ``rank`` of ``world`` would build it (LitData reads the
    rank from the environment when there is no process group)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("GLOBAL_RANK", str(rank))
    dataset = w.streaming_dataset(data, drop_last=drop_last)
    return litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)


def saved_state(monkeypatch, data, world, workers, batch, batches, drop_last=True):
    """The state a StreamingDataLoader at this topology saves after ``batches`` batches of its
    first epoch (what Lightning puts in the checkpoint)."""
    loader = loader_at(monkeypatch, data, world, 0, workers, batch, drop_last)
    len(loader)
    loader._num_samples_yielded_streaming = batches * batch
    loader.current_epoch = loader.dataset.current_epoch = 1
    return copy.deepcopy(loader.state_dict())


def yielded(monkeypatch, data, state, world, workers, batch, drop_last=True):
    """Per rank, the batches and sample ids LitData yields resuming ``state`` at this topology
    (every worker of every rank read in this process, as its DataLoader worker would)."""
    from litdata.utilities.env import _WorkerEnv

    batches, ids = [], collections.Counter()
    for rank in range(world):
        count = 0
        for worker in range(max(1, workers)):
            loader = loader_at(monkeypatch, data, world, rank, workers, batch, drop_last)
            loader.load_state_dict(copy.deepcopy(state))
            loader.dataset._forced_worker_env = _WorkerEnv(max(1, workers), worker)
            items = list(loader.dataset)
            ids.update(int(item[0]) for item in items)
            count += -(-len(items) // batch)
        batches.append(count)
    return tuple(batches), ids


def trained_before(monkeypatch, data, world, workers, batch, batches, drop_last=True):
    """The ids the first ``batches`` batches of every rank trained in a fresh epoch 1 (the
    DataLoader takes batch i from worker i mod workers)."""
    from litdata.utilities.env import _WorkerEnv

    ids: collections.Counter = collections.Counter()
    for rank in range(world):
        for worker in range(max(1, workers)):
            loader = loader_at(monkeypatch, data, world, rank, workers, batch, drop_last)
            len(loader)
            loader.dataset._forced_worker_env = _WorkerEnv(max(1, workers), worker)
            loader.dataset.set_epoch(1)
            mine = sum(1 for i in range(batches) if i % max(1, workers) == worker)
            stream = iter(loader.dataset)
            ids.update(int(next(stream)[0]) for _ in range(mine * batch))
    return ids


@pytest.mark.parametrize(
    ("saved", "batches", "now", "drop_last", "expected"),
    [
        # 2 -> 3 ranks, 0 -> 2 workers: 48 done, 48 left, 4 batches a rank (the chain below)
        ((2, 0, 4), 6, (3, 2, 4), True, {"batches": (4, 4, 4)}),
        # 3 ranks x 2 workers -> 2 ranks: 60 done, rounded down to 56 (global batches of 8)
        ((3, 2, 4), 5, (2, 0, 4), True, {"batches": (5, 5), "repeated": 4}),
        ((2, 0, 4), 4, (1, 0, 4), True, {"batches": (16,)}),
        # 40 done per rank, more than a rank's whole epoch at 3 (32): LitData raised; 80 done
        # are rounded down to 72 (global batches of 12): 8 again
        ((2, 0, 4), 10, (3, 0, 4), True, {"batches": (2, 2, 2), "repeated": 8}),
        # without drop_last, 96 - 15 samples left in batches of 5: ranks 0 and 1 get 6
        # batches, rank 2 gets 5; the loop runs 5 on each (and 24 done are rounded down to 15)
        ((2, 0, 4), 3, (3, 0, 5), False, {"batches": (6, 6, 5), "repeated": 9, "uneven": 2}),
        # 92 of 96 done, rounded down to 91 (batches of 7): the 5 left are fewer than a batch,
        # drop_last deals none, so none is dealt again (the 4 never trained are dropped)
        ((1, 0, 4), 23, (1, 0, 7), True, {"batches": (0,), "dropped": 4}),
    ],
    ids=["2to3-workers", "3to2-repeats", "2to1", "2to3-late", "2to3-uneven", "batch-4to7-late"],
)
def test_the_resume_plan_is_what_litdata_yields(
    monkeypatch, data, saved, batches, now, drop_last, expected
) -> None:
    state = saved_state(monkeypatch, data, *saved, batches, drop_last)
    world, workers, batch = now
    loader = loader_at(monkeypatch, data, world, 0, workers, batch, drop_last)
    assert litdata_plan.elastic(loader, state, world)
    plan = litdata_plan.resume_plan(loader, state, world)
    assert dataclass_fields(plan) == {
        "repeated": 0,
        "skipped": 0,
        "dropped": 0,
        "uneven": 0,
        **expected,
    }
    litdata_plan.prepare_state(loader, state, world)
    got, ids = yielded(monkeypatch, data, state, world, workers, batch, drop_last)
    assert got == plan.batches
    assert sum(ids.values()) == len(ids), "LitData's resumed pass yields a sample twice"
    before = trained_before(monkeypatch, data, *saved, batches, drop_last)
    assert sum(1 for i in ids if i in before) == plan.repeated


def dataclass_fields(plan: Any) -> dict[str, Any]:
    return {k: getattr(plan, k) for k in ("batches", "repeated", "skipped", "dropped", "uneven")}


def test_litdata_alone_fails_a_late_resume_at_more_ranks(monkeypatch, data) -> None:
    # what prepare_state corrects: 40 samples yielded per rank at 2 ranks, more than the 32 of
    # a rank's whole epoch at 3, although the elastic resume reads sample_in_epoch only
    state = saved_state(monkeypatch, data, 2, 0, 4, 10)
    with pytest.raises(ValueError, match="num_samples_yielded"):
        yielded(monkeypatch, data, state, 3, 0, 4)


def test_a_partly_read_chunk_is_counted_as_skipped_with_the_window_shuffle(
    monkeypatch, data
) -> None:
    # LitData's window shuffle (parallel file systems) resumes whole chunks only
    monkeypatch.setenv("LITDATA_POSIX_FAST", "1")
    state = saved_state(monkeypatch, data, 1, 0, 4, 2, drop_last=False)  # 8 of a chunk of 12
    loader = loader_at(monkeypatch, data, 2, 0, 0, 4, drop_last=False)
    plan = litdata_plan.resume_plan(loader, state, 2)
    litdata_plan.prepare_state(loader, state, 2)
    got, ids = yielded(monkeypatch, data, state, 2, 0, 4, drop_last=False)
    assert got == plan.batches
    before = trained_before(monkeypatch, data, 1, 0, 4, 2, drop_last=False)
    assert plan.skipped == 4 and not set(ids) & set(before)
    assert w.N - len(set(ids) | set(before)) == plan.skipped + plan.dropped


def test_a_dataset_built_before_the_process_group_is_fixed_when_only_its_rank_is_wrong(
    monkeypatch, data, caplog
) -> None:
    # under torchrun: WORLD_SIZE is set, GLOBAL_RANK is not, so every rank reads as rank 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("GLOBAL_RANK", raising=False)
    loader = litdata.StreamingDataLoader(w.streaming_dataset(data, drop_last=True), batch_size=4)
    assert loader.dataset.distributed_env.global_rank == 0
    agreed = []
    with caplog.at_level(logging.WARNING, "lightning_elastic"):
        litdata_ranks.check_ranks(
            loader, rank=1, replicas=2, all_agree=lambda ok: agreed.append(ok) or ok
        )
    assert agreed == [True]
    env = loader.dataset.distributed_env
    assert (env.world_size, env.global_rank) == (2, 1)
    assert "would have read rank 0's samples on rank 1" in caplog.text
    assert "train_dataloader()" in caplog.text
    # rank 1's half, not rank 0's
    fixed = {int(s[0]) for s in loader.dataset}
    monkeypatch.setenv("GLOBAL_RANK", "0")
    rank0 = {int(s[0]) for s in w.streaming_dataset(data, drop_last=True)}
    assert len(fixed) == len(rank0) == w.N // 2 and not fixed & rank0


def test_a_dataset_set_up_for_another_world_is_refused_on_every_rank(
    monkeypatch, data, caplog
) -> None:
    # Lightning's own launcher: rank 0 built it before WORLD_SIZE was set (a world of 1, no
    # drop_last); the other ranks agree to refuse with it
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("GLOBAL_RANK", raising=False)
    loader = litdata.StreamingDataLoader(w.streaming_dataset(data, drop_last=None), batch_size=4)
    with pytest.raises(DataShardingError, match=r"world of 1 \(rank 0\).*train_dataloader\(\)"):
        litdata_ranks.check_ranks(loader, rank=0, replicas=2, all_agree=lambda ok: ok)
    monkeypatch.setenv("WORLD_SIZE", "2")
    dataset = w.streaming_dataset(data, drop_last=True)
    wrong_rank = litdata.StreamingDataLoader(dataset, batch_size=4)
    with (
        caplog.at_level(logging.WARNING, "lightning_elastic"),
        pytest.raises(DataShardingError, match="another rank"),
    ):
        litdata_ranks.check_ranks(wrong_rank, rank=1, replicas=2, all_agree=lambda ok: False)
    # on a rank whose dataset only had its rank wrong: nothing said fixed, as nothing runs
    assert wrong_rank.dataset.distributed_env.global_rank == 0 and not caplog.text


def test_the_litdata_internals_we_rely_on_are_there() -> None:
    assert not litdata_plan.missing(), f"LitData {litdata.__version__} moved them"


# ---------------------------------------------------------------------- multi-process


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> dict[str, Any]:
    """One launch at 2 ranks: the same-world fits, and the chain's first part."""
    root = tmp_path_factory.mktemp("two")
    ranks = run_distributed(
        w.same_world, 2, str(root), data, max_epochs=3, chain_crash_at=8, timeout=360
    )
    return {"root": root, "ranks": ranks}


@pytest.mark.slow
@pytest.mark.parametrize("config", ["w0", "w2"], ids=["0workers-drop_last", "2workers"])
def test_same_world_resume_is_exact_across_epoch_boundaries(two_ranks, config) -> None:
    for rank in two_ranks["ranks"]:
        run = rank[config]
        reference, resumed = run["reference"], run["resumed"]
        assert run["crashed"]["crashed"] and not resumed["crashed"]
        assert resumed["resumed_from"].endswith("step_000000015")  # mid-epoch 1 of 3
        assert resumed["seen"] == [s for s in reference["seen"] if s[0] >= 15]
        assert resumed["losses"] == [s for s in reference["losses"] if s[0] >= 15]  # bitwise
        assert (resumed["global_step"], resumed["current_epoch"]) == (36, 3)
    ends = [r for r in journal.read(two_ranks["root"] / config / "run" / "journal")]
    last = max(r["inc"] for r in ends)
    ends = [(r["epoch"], r["step"]) for r in ends if r["kind"] == "epoch_end" and r["inc"] == last]
    assert sorted(set(ends)) == [(1, 24), (2, 36)], "an epoch end without its batches"


@pytest.mark.slow
def test_a_resume_after_the_save_at_an_epochs_end_continues_litdatas_epochs(two_ranks) -> None:
    # max_steps=12 stops (and saves) at the end of epoch 0; Lightning loads no loader state
    # into a loop whose epoch ended, so LitData started over at its epoch 1 (epoch 0's order
    # again); it continues with its epoch 2
    for rank in two_ranks["ranks"]:
        reference, run = rank["w0"]["reference"], rank["boundary"]
        assert run["stopped"]["global_step"] == 12
        resumed = run["resumed"]
        assert resumed["resumed_from"].endswith("step_000000012")
        # the same batches (the losses differ: the RNG saved at the end of a fit misses the
        # seed the next epoch's DataLoader iterator draws, with any loader)
        assert resumed["seen"] == [s for s in reference["seen"] if s[0] >= 12]
        assert (resumed["global_step"], resumed["current_epoch"]) == (36, 3)


@pytest.mark.slow
def test_a_dataset_built_before_the_process_group_reads_its_own_rank(two_ranks) -> None:
    # the 0-worker resumption above built its dataset before the process group (exact: rank
    # 1 read rank 1's samples); rank 1 said what it fixed, rank 0 had nothing to fix
    logs = [rank["w0"]["resumed"]["log"] for rank in two_ranks["ranks"]]
    fixed = ["would have read rank 0's samples on rank 1" in m for m in logs[1]]
    assert sum(fixed) == 1
    assert not any("set up before the process group" in m for m in logs[0])


@pytest.mark.slow
def test_world_size_changes_end_every_epoch_where_its_data_ends(two_ranks, data) -> None:
    # 96 samples, batch 4, every=3. 2 ranks crashed at 8: resume from 6, mid-epoch 0 (12 a
    # rank). 3 ranks x 2 workers: 48 done, 48 left, 4 batches; epoch 0 ends at 10; epoch 1
    # (8) crashes at 16: resume from 15, 5 of its batches done (60 samples). 2 ranks: 60
    # rounded down to 56 (global batches of 8): 4 samples again (warned), 40 left, 5
    # batches; epoch 1 ends at 20; epoch 2 (12) crashes at 26: resume from 24, 4 done. 1
    # rank: 32 done, 64 left: epoch 2 ends at 40; epoch 3 (24) ends at 64
    root = two_ranks["root"] / "chain"
    assert all(rank["chain"]["crashed"] for rank in two_ranks["ranks"])
    plan = [(3, 2, 16), (2, 0, 26), (1, 0, -1)]
    logs = {}
    for world, workers, crash_at in plan:
        results = run_distributed(
            w.fit,
            world,
            str(root),
            data,
            max_epochs=EPOCHS,
            workers=workers,
            crash_at=crash_at,
            timeout=300,
        )
        assert all(r["crashed"] == (crash_at > 0) for r in results)
        logs[world] = results[0]["log"]
    assert (results[0]["global_step"], results[0]["current_epoch"]) == (64, EPOCHS)
    records = journal.read(root / "journal")
    last = {}
    for r in records:
        if r["kind"] == "epoch_end" and "rank0" in r["file"]:
            last[r["epoch"]] = (r["step"], r["num_training_batches"], r["batches"], r["world"])
    assert last == {0: (10, 10, 4, 3), 1: (20, 10, 5, 2), 2: (40, 20, 16, 1), 3: (64, 24, 24, 1)}
    per_epoch = journal.samples_per_epoch(records, 64)
    for epoch, counts in per_epoch.items():
        assert set(counts) == set(range(w.N)), f"epoch {epoch} misses samples"
        repeated = sum(counts.values()) - len(counts)
        assert repeated == (4 if epoch == 1 else 0), f"epoch {epoch}: {repeated} twice"
    warned = [m for m in logs[2] if "cannot train every sample of epoch" in m]
    assert len(warned) == 1 and "4 sample(s) trained before the save are dealt again" in warned[0]
    assert "every sample of epoch 1 (LitData's epoch 2)" in warned[0]  # the loop's, and LitData's
    assert not any("cannot train every sample" in m for m in logs[3] + logs[1])


@pytest.mark.parametrize("corrected", [True, False], ids=["corrected", "litdata-alone"])
def test_a_second_resume_at_the_new_topology_continues_the_elastic_plan(
    monkeypatch, data, corrected
) -> None:
    # 2 ranks -> 3 ranks x 2 workers after 3 batches; 2 more batches there, saved, resumed
    # at 3 x 2 again. The state saved with workers lacked resume_mode="elastic" (only a
    # dataset iterated in the main process records it): LitData then replayed the fresh
    # epoch's plan, training again samples of before both saves
    from litdata.utilities.env import _WorkerEnv

    first = saved_state(monkeypatch, data, 2, 0, 4, 3)
    loader = loader_at(monkeypatch, data, 3, 0, 2, 4)
    if corrected:
        litdata_plan.prepare_state(loader, first, 3)
    done = trained_before(monkeypatch, data, 2, 0, 4, 3)
    for rank in range(3):  # the 2 batches each rank trained at 3 x 2 (one from each worker)
        for worker in range(2):
            reader = loader_at(monkeypatch, data, 3, rank, 2, 4)
            reader.load_state_dict(copy.deepcopy(first))
            reader.dataset._forced_worker_env = _WorkerEnv(2, worker)
            stream = iter(reader.dataset)
            done.update(int(next(stream)[0]) for _ in range(4))
    loader.load_state_dict(copy.deepcopy(first))
    len(loader)
    loader._num_samples_yielded_streaming = 2 * 4
    second = copy.deepcopy(loader.state_dict())
    assert litdata_plan.elastic(loader, second, 3) == corrected
    got, ids = yielded(monkeypatch, data, second, 3, 2, 4)
    again = sum(1 for i in ids if i in done)
    if corrected:  # 6 batches a rank at 3 x 2, 2 done: 4 left
        assert got == litdata_plan.resume_plan(loader, second, 3).batches == (4, 4, 4)
        assert again == 0 and sum(ids.values()) == w.N - sum(done.values())
    else:
        assert again > 0


# ---------------------------------------------------------------------- hostile, in one process


@pytest.fixture(scope="module")
def small(data, tmp_path_factory) -> str:
    return w.write(tmp_path_factory.mktemp("litdata") / "small", n=24)


@pytest.fixture(scope="module")
def one_rank(data, small, tmp_path_factory) -> dict[str, Any]:
    """In this process, no process group: for each case an uninterrupted fit, one that crashes
    and its resumption."""
    root = tmp_path_factory.mktemp("one")
    cases = {
        # limit_train_batches=4 of 24: the save at step 4 is at epoch 0's end, LitData's pass
        # is not over; the crash is in epoch 1
        "limit": ({"max_epochs": 3, "every": 2, "limit_train_batches": 4}, 5),
        # 96 + 24 samples, 30 batches an epoch: the crash mid-epoch 0, resumed from step 10
        "combined": ({"max_epochs": 2, "every": 10, "combined_with": small}, 15),
    }
    runs = {}
    with warnings.catch_warnings():  # Lightning's, about any IterableDataset with a length
        warnings.filterwarnings("ignore", ".*IterableDataset. has .__len__. defined")
        warnings.filterwarnings("ignore", ".*does not have many workers")
        for name, (kw, crash_at) in cases.items():
            runs[name] = {
                "reference": w.fit(f"{root}/{name}/ref", data, **kw),
                "crashed": w.fit(f"{root}/{name}/run", data, crash_at=crash_at, **kw),
                "resumed": w.fit(f"{root}/{name}/run", data, **kw),
            }
        # batch 4 crashed after 23 of 24 batches (saved there), resumed with batch 7: the
        # 4 samples left are fewer than a batch, LitData's elastic resume deals none
        crashed = w.fit(f"{root}/empty", data, max_epochs=2, crash_at=23, every=23)
        resumed = w.fit(f"{root}/empty", data, max_epochs=2, every=23, batch_size=7)
        runs["empty"] = {"crashed": crashed, "resumed": resumed, "root": f"{root}/empty"}
    return runs


def assert_resumed_exactly(run: dict[str, Any], saved_at: int, steps: int) -> None:
    reference, resumed = run["reference"], run["resumed"]
    assert run["crashed"]["crashed"] and not resumed["crashed"]
    assert resumed["resumed_from"].endswith(f"step_{saved_at:09d}")
    assert resumed["seen"] == [s for s in reference["seen"] if s[0] >= saved_at]
    assert resumed["losses"] == [s for s in reference["losses"] if s[0] >= saved_at]  # bitwise
    assert (resumed["global_step"], resumed["current_epoch"]) == (steps, reference["current_epoch"])


def test_a_save_at_the_end_of_an_epoch_cut_by_limit_train_batches_resumes_the_next_epoch(
    one_rank,
) -> None:
    # the epoch's 4 batches do not run LitData's pass to its end: its state (16 of 96 samples)
    # is mid-pass, and LitData replayed the rest of that pass as the loop's next epoch
    assert_resumed_exactly(one_rank["limit"], 4, 12)


def test_a_combined_streaming_dataset_trains_and_resumes_exactly_across_an_epoch_end(
    one_rank,
) -> None:
    # it crashed at setup (its state has no input_dir of its own); resumed, the epoch after
    # the resumed one is a whole one (LitData ends the resumed pass when the loop says so)
    assert_resumed_exactly(one_rank["combined"], 10, 60)


class Trainer:
    """What :func:`litdata_loaders.adopt` reads of a trainer whose fit loop restarts."""

    def __init__(self, restarting: bool = True) -> None:
        self.fit_loop = type("FitLoop", (), {"restarting": restarting})()
        self.global_rank = 0
        self.reload_dataloaders_every_n_epochs = 0


def first_ids(loader, n=8) -> list[int]:
    return [int(i) for batch in itertools.islice(iter(loader), n // 4) for i in batch[0]]


MID_EPOCH_2 = litdata_loaders.LoopPosition(epoch=2, batches=5, last_batch=False, resumed=True)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s.pop("current_epoch"), "current_epoch=None"),
        (lambda s: s.update(num_samples_yielded=None), "num_samples_yielded=None"),
        (
            lambda s: s["dataset"].update(num_samples_yielded="20"),
            "dataset num_samples_yielded='20'",
        ),
        (lambda s: s["dataset"].pop("batch_size"), "dataset batch_size=None"),
        (lambda s: s["dataset"].update(seed=None), "dataset seed=None"),
        (lambda s: s["dataset"].update(current_epoch=-3), "dataset current_epoch=-3"),
    ],
    ids=["no-epoch", "yielded-none", "yielded-str", "no-batch-size", "seed-none", "epoch<0"],
)
def test_hostile_a_hand_edited_litdata_state_starts_the_epoch_over_with_a_warning(
    monkeypatch, data, caplog, edit, named
) -> None:
    state = saved_state(monkeypatch, data, 1, 0, 4, 5)
    edit(state)
    alone = loader_at(monkeypatch, data, 1, 0, 0, 4)
    with pytest.raises((KeyError, TypeError, ValueError)):  # LitData alone, deep in the fit
        alone.load_state_dict(copy.deepcopy(state))
        first_ids(alone)
    loader = loader_at(monkeypatch, data, 1, 0, 0, 4)
    with caplog.at_level(logging.WARNING, "lightning_elastic"):
        follower = litdata_loaders.adopt(
            loader, Trainer(), world=1, states=[state], loop=MID_EPOCH_2
        )
        loader.load_state_dict(state)  # what Lightning does next
    assert follower is None
    assert f"not resumed (unreadable: {named})" in caplog.text
    assert "the 5 batch(es) it did of epoch 2" in caplog.text
    # the loop's epoch 2 reads LitData's epoch 3 (as the uninterrupted run) from its start
    fresh = loader_at(monkeypatch, data, 1, 0, 0, 4)
    fresh.current_epoch = 2
    assert first_ids(loader) == first_ids(fresh)
    # and without a restarting loop (Lightning gives no state) nothing fails either
    litdata_loaders.adopt(
        loader_at(monkeypatch, data, 1, 0, 0, 4),
        Trainer(restarting=False),
        world=1,
        states=[state],
        loop=MID_EPOCH_2,
    )


def test_hostile_a_checkpoint_of_another_training_dataloader_is_not_given_to_litdata(
    monkeypatch, data, caplog
) -> None:
    # the run before trained from a map-style DataLoader (ours saves an empty state): LitData
    # failed on it with KeyError('current_epoch')
    alone = loader_at(monkeypatch, data, 1, 0, 0, 4)
    with pytest.raises(KeyError):
        alone.load_state_dict({})
    loader = loader_at(monkeypatch, data, 1, 0, 0, 4)
    with caplog.at_level(logging.WARNING, "lightning_elastic"):
        litdata_loaders.adopt(loader, Trainer(), world=1, states=[{}], loop=MID_EPOCH_2)
        loader.load_state_dict({})
    assert f"not resumed (none of its training dataloader states reads {data}:" in caplog.text
    assert loader.current_epoch == 2 and not loader.restore


def combined_loader_at(monkeypatch, data, small, world, batches=0):
    """A StreamingDataLoader over a CombinedStreamingDataset as rank 0 of ``world`` builds
    it, after ``batches`` batches."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("GLOBAL_RANK", "0")
    datasets = [w.streaming_dataset(d, drop_last=True) for d in (data, small)]
    combined = litdata.CombinedStreamingDataset(datasets, seed=42, iterate_over_all=True)
    loader = litdata.StreamingDataLoader(combined, batch_size=4)
    if batches:
        first_ids(loader, 4 * batches)
    return loader


def test_hostile_a_combined_dataset_resumed_at_another_world_starts_its_epoch_over(
    monkeypatch, data, small, caplog
) -> None:
    # LitData refuses it (ValueError in load_state_dict, at every restart of an elastic job)
    state = copy.deepcopy(combined_loader_at(monkeypatch, data, small, 2, batches=3).state_dict())
    alone = combined_loader_at(monkeypatch, data, small, 3)
    with pytest.raises(ValueError, match="match the checkpoint"):
        alone.load_state_dict(copy.deepcopy(state))
    loader = combined_loader_at(monkeypatch, data, small, 3)
    loop = litdata_loaders.LoopPosition(epoch=0, batches=3, last_batch=False, resumed=True)
    with caplog.at_level(logging.WARNING, "lightning_elastic"):
        litdata_loaders.adopt(loader, Trainer(), world=3, states=[state], loop=loop)
        loader.load_state_dict(state)
    assert (
        "LitData resumes a CombinedStreamingDataset only at the topology it was saved at "
        "(2 rank(s) x 1 worker(s) x batch 4; now 3 x 1 x 4)" in caplog.text
    )
    assert "the 3 batch(es) it did of epoch 0" in caplog.text
    assert first_ids(loader) == first_ids(combined_loader_at(monkeypatch, data, small, 3))


def test_a_global_batch_size_the_streaming_loader_does_not_have_is_refused_with_the_numbers(
    monkeypatch, data
) -> None:
    loader = loader_at(monkeypatch, data, 2, 0, 0, 4)
    position = litdata_loaders.LoopPosition(epoch=0, batches=0, last_batch=False, resumed=False)
    kw = {"states": [], "loop": position}
    with pytest.raises(ConfigError, match=r"per-rank batch of 6 at world size 2.*batch_size=4"):
        litdata_loaders.adopt(loader, Trainer(False), world=2, global_batch_size=12, **kw)
    with pytest.raises(WorldSizeError, match=r"global_batch_size=12 is not divisible by .* 5"):
        litdata_loaders.adopt(loader, Trainer(False), world=5, global_batch_size=12, **kw)
    litdata_loaders.adopt(loader, Trainer(False), world=2, global_batch_size=8, **kw)


def test_a_dataset_sharded_over_more_processes_than_replicas_is_refused_as_model_parallel(
    monkeypatch, data
) -> None:
    # built where the process group exists (4 processes), under a strategy that trains 2
    # data-parallel replicas: not a dataset "built before the process group"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("GLOBAL_RANK", "2")
    loader = litdata.StreamingDataLoader(w.streaming_dataset(data, drop_last=True), batch_size=4)
    with pytest.raises(DataShardingError, match=r"shards over all 4 processes .* 2 data-para"):
        litdata_ranks.check_ranks(loader, rank=1, replicas=2, all_agree=lambda ok: ok)


class PlainLoader(w.LitDataModule):
    """A LitData dataset in a torch DataLoader (nothing keeps its position)."""

    def train_dataloader(self) -> Any:
        dataset = w.streaming_dataset(self.data, drop_last=True)
        return torch.utils.data.DataLoader(dataset, batch_size=4)


class BuiltBeforeTheGroup(w.LitDataModule):
    """Validates on a StreamingDataset set up as rank 1 of 2 would have without a process
    group (the strategy here: rank 0 of 1)."""

    def val_dataloader(self) -> Any:
        return litdata.StreamingDataLoader(self.validation, batch_size=4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def fit_briefly(tmp_path, model) -> None:
    trainer = make_trainer(
        str(tmp_path),
        max_steps=2,
        devices=1,
        strategy="auto",
        callbacks=[DistributedCheckpoint(str(tmp_path / "ckpts"))],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*IterableDataset. has .__len__. defined")
        warnings.filterwarnings("ignore", ".*does not have many workers")
        trainer.fit(model)


def test_a_litdata_dataset_in_a_torch_dataloader_is_said_not_to_resume(
    tmp_path, data, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(litdata_loaders, "_WARNED", set())
    with caplog.at_level(logging.WARNING, "lightning_elastic"):
        fit_briefly(tmp_path, PlainLoader(data, 0, True, n=w.N))
    assert "(DataLoader over a LitData StreamingDataset) cannot resume" in caplog.text
    assert "Build it as litdata.StreamingDataLoader" in caplog.text
    assert "torchdata" not in caplog.text  # not the advice for other iterables


def test_a_validation_dataset_built_before_the_process_group_is_refused_too(
    tmp_path, data, monkeypatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("GLOBAL_RANK", "1")
    validation = w.streaming_dataset(data, drop_last=True)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("GLOBAL_RANK")
    model = BuiltBeforeTheGroup(data, 0, True, n=w.N)
    model.validation = validation
    with pytest.raises(DataShardingError, match=r"world of 2 \(rank 1\).* in val_dataloader\(\)"):
        fit_briefly(tmp_path, model)


def test_a_resume_that_leaves_no_batch_of_the_epoch_ends_it_at_once(one_rank) -> None:
    # the loop's epoch 0 ends where it was saved (its length was reported as the 23 batches
    # done: Lightning then started epoch 0 over, with LitData's next epoch as its rest, 88 of
    # 96 samples twice at 2 -> 3 ranks); epoch 1 is a whole LitData epoch of 13 batches of 7
    run = one_rank["empty"]
    assert run["crashed"]["crashed"] and run["resumed"]["resumed_from"].endswith("000000023")
    assert (run["resumed"]["global_step"], run["resumed"]["current_epoch"]) == (36, 2)
    records = journal.read(f"{run['root']}/journal")
    ends = [(r["epoch"], r["step"], r["batches"]) for r in records if r["kind"] == "epoch_end"]
    assert ends == [(0, 23, 0), (1, 36, 13)]
    per_epoch = journal.samples_per_epoch(records, 36)
    assert (len(per_epoch[0]), len(per_epoch[1])) == (92, 91)
    assert all(n == 1 for counts in per_epoch.values() for n in counts.values())
    # the metric states saved mid-epoch 0 are put back where its first resumed batch would
    # have started: epoch 0's epoch-end metrics count its 92 samples, epoch 1's its own 91
    metrics = run["resumed"]["epoch_metrics"]
    assert [(m["epoch"], len(m["id_cat"])) for m in metrics] == [(0, 92), (1, 91)]


def test_a_sigint_handler_left_by_optimize_is_named_at_fit_start(tmp_path, caplog) -> None:
    """LitData's optimize() leaves a SIGINT handler that ends the process with exit code 0 (it
    ended this suite's pytest run once): a fit says so, and leaves the handler alone."""
    import signal

    from litdata.processing.data_processor import DataProcessor

    from lightning_elastic.lightning import litdata_loaders
    from tests.lightning.models import TinyModule

    processor = DataProcessor.__new__(DataProcessor)  # the object optimize() leaves behind
    previous = signal.signal(signal.SIGINT, processor._signal_handler)
    try:
        litdata_loaders._WARNED.discard("sigint")
        trainer = make_trainer(
            str(tmp_path),
            max_steps=2,
            devices=1,
            callbacks=[DistributedCheckpoint(tmp_path / "ckpt")],
        )
        with caplog.at_level(logging.WARNING, "lightning_elastic"):
            trainer.fit(TinyModule())
        assert signal.getsignal(signal.SIGINT) == processor._signal_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert caplog.text.count("optimize() left its SIGINT handler") == 1, caplog.text
    assert "DataProcessor._signal_handler" in caplog.text
    assert "signal.default_int_handler" in caplog.text
