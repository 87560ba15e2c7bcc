"""What Lightning reads from earlier steps and validations survives a resume:
``trainer.callback_metrics`` (and the logged and progress-bar values), the epoch-level
``self.log`` accumulators of the interrupted epoch, and the ``ReduceLROnPlateau`` steps that
read ``val_loss`` between validations.

Validation runs every 5 global steps, epochs have 8 batches, checkpoints are taken every 5
steps and at every epoch's end. The model carries the whole grid of plateau schedulers on its
one optimizer (``logged_workers.PLATEAUS``: ``interval="step"`` with frequencies 1, 4, 5, 6
and 8, ``interval="epoch"`` with 1 and 2, ``strict=True`` and ``False``); each training batch
records the loss, the learning rate and every scheduler's state, and a callback records what
``on_train_batch_end`` sees in ``trainer.callback_metrics``, ``logged_metrics`` and
``progress_bar_metrics``. A resume must reproduce all of it bitwise from the checkpoint's
step, and the values of every epoch that ends after it.

The resume points run in this process on one device (the world size plays no part in them;
a "kill" is a resume from an uninterrupted run's checkpoint); the issue's scenario (2
processes, SIGKILL after step 13, relaunch) takes two launches, and a world-size change
resumes their checkpoint in this process.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_elastic.lightning import logged, logged_format
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import logged_workers
from tests.lightning.logged_workers import PLATEAUS, plateau_name

pytestmark = pytest.mark.timeout(300)

MAX_STEPS = 17  # past every scheduler's first read after steps 8, 10 and 15, and epoch 1


def checkpoint(root: Path, step: int) -> str:
    return str(root / "ckpts" / f"step_{step:09d}")


def assert_continues_bitwise(
    reference: dict[str, Any], resumed: dict[str, Any], start: int
) -> None:
    """From ``start`` on: the same batches, losses, learning rates and plateau states, the
    same metrics shown to callbacks, loggers and the progress bar at every batch end, and the
    same values of every epoch that ends after the resume."""
    expected = [r for r in reference["records"] if r[0] >= start]
    got = resumed["records"]
    assert [r[:2] for r in got] == [r[:2] for r in expected], "different batches after resume"
    for want, have in zip(expected, got, strict=True):
        drifted = [
            plateau_name(*PLATEAUS[i])
            for i, (a, b) in enumerate(zip(want[4], have[4], strict=True))
            if a != b
        ]
        assert not drifted, f"step {want[0]}: plateau scheduler(s) {drifted} drifted"
        assert want == have, f"step {want[0]}: loss or learning rate drifted"
    seen = [s for s in reference["seen"] if s[0] > start]
    assert seen, "nothing trained after the resume"
    assert "val_loss" in resumed["seen"][0][1], "callback_metrics lost the last validation"
    for want, have in zip(seen, resumed["seen"], strict=True):
        assert have == want, f"step {want[0]}: callback/logged/progress-bar metrics differ"
    # a callback before ours reads the last validation already at the first resumed batch's
    # (and a resumed epoch's) start; the hooks of an epoch's start ran before a save at its
    # first batch, and are not run again
    started = [s for s in reference["started"] if s[1] >= start]
    assert resumed["started"] == started[-len(resumed["started"]) :]
    assert "val_loss" in resumed["started"][0][2]
    epochs = [e for e in reference["epoch_values"] if e[0] >= start // 8]
    assert resumed["epoch_values"] == epochs
    assert set(epochs[0][1]) >= {"train_loss_epoch", "id_total", "id_mean", "train_mae"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted single-device run."""
    root = tmp_path_factory.mktemp("reference")
    return root, logged_workers.fit(str(root), MAX_STEPS, devices=1)


# what each resume point reads before the next validation (at the next multiple of 5) or
# epoch end (at the next multiple of 8)
@pytest.mark.parametrize(
    "start",
    [
        pytest.param(8, id="epoch-end-8-step1-at-9"),
        pytest.param(10, id="mid-epoch-10-step1-at-11-step4-at-12-step5-at-13-step6-at-14"),
        pytest.param(15, id="mid-epoch-15-step8-epoch1-epoch2-at-16"),
    ],
)
def test_a_resume_between_validations_continues_plateaus_and_logged_values_bitwise(
    tmp_path, reference, start
) -> None:
    ref_root, expected = reference
    source = checkpoint(ref_root, start)
    resumed = logged_workers.fit(str(tmp_path), MAX_STEPS, devices=1, ckpt_path=source)
    assert resumed["resumed_from"] == source
    assert_continues_bitwise(expected, resumed, start)


def test_a_self_log_edited_between_the_save_and_the_resume_starts_afresh_instead_of_failing(
    tmp_path,
) -> None:
    """Lightning refuses a ``self.log`` whose arguments differ from its entry's; restored
    entries made every restart after an edit (``prog_bar=True`` added, another reduction)
    fail at its first batch. Such an entry is dropped with a warning naming it and logged
    afresh; the others keep their epoch values."""
    root = str(tmp_path)
    logged_workers.fit_edited(root, 7, None)  # checkpoints at 5; stops at 7, inside epoch 0
    with pytest.warns(UserWarning, match=r"self.log\('train_loss', ...\) is called with other"):
        resumed = logged_workers.fit_edited(root, 8, {"prog_bar": False, "reduce_fx": "max"})
    assert resumed["resumed_from"].endswith("step_000000005")
    (epoch, values), *_ = resumed["epoch_values"]
    assert epoch == 0
    assert values["id_total"] == sum(range(32))  # restored, untouched by the edit
    assert "train_loss_epoch" in values  # the edited value, over the resumed batches


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted run whose checkpoints are ModelCheckpoint's, after validations."""
    root = tmp_path_factory.mktemp("native")
    return root, logged_workers.fit_native(str(root), MAX_STEPS)


@pytest.mark.parametrize("start", [5, 10])
def test_a_lightning_checkpoint_saved_after_a_mid_epoch_validation_resumes_bitwise(
    tmp_path, native, start
) -> None:
    """``ModelCheckpoint(monitor="val_loss")`` saves in ``on_validation_end``, inside the
    training epoch, where Lightning marks the loop as outside one: the checkpoint held no
    data position (the resume replayed the epoch's batches) and no epoch accumulators."""
    ref_root, expected = native
    source = str(ref_root / "mc" / f"step={start}.ckpt")
    resumed = logged_workers.fit_native(str(tmp_path), MAX_STEPS, ckpt_path=source)
    assert resumed["resumed_from"] == source
    assert_continues_bitwise(expected, resumed, start)


# ---------------------------------------------------------------- 2 processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, Any]:
    """The issue's scenario on 2 processes: SIGKILLed after step 13 (the newest checkpoint
    is step 10), then relaunched; the relaunch also runs the uninterrupted reference."""
    root = tmp_path_factory.mktemp("two-ranks")
    run = str(root / "run")
    run_distributed(logged_workers.fit, 2, run, MAX_STEPS, kill_at=13, may_die={0, 1})
    runs = [(run, MAX_STEPS, {}), (str(root / "reference"), MAX_STEPS, {})]
    done = run_distributed(logged_workers.fits, 2, runs, timeout=180)
    return {
        "root": root,
        "resumed": [rank[0] for rank in done],
        "reference": [rank[1] for rank in done],
    }


@pytest.mark.slow
def test_two_ranks_killed_after_step_13_resume_their_own_logged_values_bitwise(
    two_ranks,
) -> None:
    resumed, reference = two_ranks["resumed"], two_ranks["reference"]
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith("run/ckpts/step_000000010")
        assert_continues_bitwise(reference[rank], resumed[rank], 10)
    # a value logged without sync_dist differs per rank: each rank got its own back
    first = [resumed[rank]["seen"][0][1] for rank in range(2)]
    assert first[0]["rank_ids_epoch"] != first[1]["rank_ids_epoch"]


@pytest.mark.slow
def test_a_world_size_change_folds_the_epoch_accumulators_of_every_saved_rank(
    tmp_path, two_ranks
) -> None:
    # the 2-rank run's checkpoint of step 10 (mid-epoch 1), resumed by one process: the
    # epoch's remaining samples go to it, and its epoch values (logged with sync_dist, of
    # sample ids) cover the whole epoch, as the 2 ranks' did
    reference = two_ranks["reference"][0]
    source = checkpoint(two_ranks["root"] / "reference", 10)
    # 48 samples of epoch 1 are left: 12 batches of 4 at one rank, to step 22
    resumed = logged_workers.fit(str(tmp_path), 22, devices=1, n=64, ckpt_path=source)
    assert resumed["resumed_from"] == source
    assert [e for e, _ in resumed["epoch_values"]] == [1]
    values = resumed["epoch_values"][0][1]
    expected = next(v for e, v in reference["epoch_values"] if e == 1)
    for name in ("id_total", "id_top", "id_low", "id_mean"):
        assert values[name] == expected[name], name
    assert values["id_total"] == sum(range(64))
    # every rank shows rank 0's last validation (the strict plateau at step 13 read it)
    at_11 = next(s for s in reference["seen"] if s[0] == 11)
    assert resumed["seen"][0][0] == 11
    assert resumed["seen"][0][1]["val_loss"] == at_11[1]["val_loss"]


# ---------------------------------------------------------------- folding, in one process


def _capture(entries: list[dict[str, Any]], callback: dict[str, float]) -> dict[str, Any]:
    """A capture in its in-memory form (version 1's stored form: tensors in nested dicts)."""
    return {
        "version": logged_format.DECODED_VERSION,
        "callback_metrics": {k: torch.tensor(v) for k, v in callback.items()},
        "logged_metrics": {},
        "progress_bar_metrics": {},
        "first_loop_iter": False,
        "current_fx": "training_step",
        "distributed": True,
        "results": entries,
    }


def _entry(name: str, reduce_fx: str, state: dict[str, float], count: int = 2) -> dict:
    meta = {**_full_meta(name, reduce_fx), "sync_dist": True}
    return {
        "key": f"training_step.{name}",
        "is_tensor": True,
        "meta": meta,
        "state": {k: torch.tensor(v) for k, v in state.items()},
        "forward_cache": None,
        "computed": torch.tensor(0.0),
        "has_reset": False,
        "update_count": count,
    }


def test_folding_adds_sums_and_counts_and_takes_extremes_into_rank_0_only() -> None:
    rank0 = _capture(
        [
            _entry("loss", "mean", {"value": 6.0, "cumulated_batch_size": 8}),
            _entry("total", "sum", {"value": 10.0}),
            _entry("top", "max", {"value": 7.0}),
        ],
        {"val_loss": 0.5},
    )
    rank1 = _capture(
        [
            _entry("top", "max", {"value": 9.0}),
            _entry("loss", "mean", {"value": 2.0, "cumulated_batch_size": 8}),
            _entry("total", "sum", {"value": 5.0}),
            _entry("low", "min", {"value": 3.0}),  # only rank 1 logged it
        ],
        {"val_loss": 0.7},
    )
    own = _entry("own", "mean", {"value": 4.0, "cumulated_batch_size": 8})
    own["meta"]["sync_dist"] = False  # each rank's own value
    rank1["results"].append(own)
    first, others = logged.fold([rank0, rank1])
    folded = {e["key"]: e for e in first["results"]}
    names = ("loss", "total", "top", "low", "own")
    assert list(folded) == [f"training_step.{n}" for n in names]
    assert float(folded["training_step.loss"]["state"]["value"]) == 8.0
    assert float(folded["training_step.loss"]["state"]["cumulated_batch_size"]) == 16
    assert float(folded["training_step.total"]["state"]["value"]) == 15.0
    assert float(folded["training_step.top"]["state"]["value"]) == 9.0
    assert float(folded["training_step.low"]["state"]["value"]) == 3.0
    assert folded["training_step.loss"]["update_count"] == 4
    assert all(e["computed"] is None for e in folded.values())
    # the other ranks hold the same entries, empty, of the same dtypes (an epoch-end sync
    # finds them everywhere); one that does not sync is hidden there until logged again (it
    # showed NaN, the mean of nothing, at the epoch's end on a rank that never logged it)
    rest = {e["key"]: e for e in others["results"]}
    assert list(rest) == list(folded)
    assert all(e["update_count"] == 0 for e in rest.values())
    for key, entry in rest.items():
        for attr, value in entry["state"].items():
            assert value.dtype == folded[key]["state"][attr].dtype, (key, attr)
    assert float(rest["training_step.top"]["state"]["value"]) == -math.inf
    assert float(rest["training_step.low"]["state"]["value"]) == math.inf
    assert float(rest["training_step.loss"]["state"]["cumulated_batch_size"]) == 0
    assert [k for k, e in rest.items() if e["has_reset"]] == ["training_step.own"]
    assert not any(e["has_reset"] for e in folded.values())
    # every rank shows saved rank 0's last values
    assert first["callback_metrics"] == others["callback_metrics"] == rank0["callback_metrics"]


def test_a_mean_folded_into_three_ranks_stays_exact_under_lightnings_mean_sync() -> None:
    """Lightning syncs a mean's sum and count with op "mean": summed over the ranks, then
    divided by the world size in place, an integer division for an integer count. Two saved
    ranks of 8 samples each resumed by 3: rank 0 holds the 16 saved samples, each rank adds
    16 more; 64 samples / 3 ranks truncated to 21 gave a mean of 32.0 for 31.5."""
    saved = [
        _capture([_entry("ids", "mean", {"value": v, "cumulated_batch_size": 8})], {})
        for v in (100.0, 200.0)
    ]
    first, others = logged.fold(saved)
    ranks = [first, others, others]
    values = [r["results"][0]["state"]["value"].clone() for r in ranks]
    counts = [r["results"][0]["state"]["cumulated_batch_size"].clone() for r in ranks]
    for rank in range(3):  # what each rank logs after the resume: 16 samples of sum 572
        values[rank] += 572.0
        counts[rank] += 16

    def mean_sync(tensors: list[torch.Tensor]) -> torch.Tensor:  # _sync_ddp, gloo, "mean"
        total = torch.stack(tensors).sum(dim=0)
        return total.copy_(total / 3)

    assert float(mean_sync(values) / mean_sync(counts)) == (300.0 + 3 * 572.0) / 64


def test_a_capture_is_one_small_json_document_that_gives_back_every_value_exactly(
    tmp_path,
) -> None:
    """Stored as nested dicts, a module logging 50 values added ~30 entries per value to
    every save (1.8 MB and ~0.5 s for a 220 KB model here); as one JSON document it adds two
    entries and tens of KB, and every tensor comes back with its dtype and bits (NaN and
    infinities included)."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Fifty(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            for i in range(50):
                self.log(f"value_{i}", out["loss"] * i, on_step=True, on_epoch=True)
            self.log("wide", batch.double().sum(), reduce_fx="max")
            return out

    captured: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 2:
                captured["stored"] = logged.capture(trainer)
                captured["live"] = {
                    k: dict(m.metric_state) for k, m in trainer.fit_loop.epoch_loop._results.items()
                }
                captured["callback"] = dict(trainer._logger_connector._callback_metrics)

    trainer = pl.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Capture()],
    )
    trainer.fit(Fifty())
    stored = captured["stored"]
    assert set(stored) == {"version", "json"} and stored["version"] == logged.FORMAT_VERSION
    assert len(stored["json"]) < 64_000
    decoded = logged_format.decode(stored)
    assert decoded is not None and not decoded.skipped
    assert len(decoded["results"]) == 51 and decoded["epoch_open"] is True
    for entry in decoded["results"]:
        live = captured["live"][entry["key"]]
        assert entry["state"].keys() == live.keys()
        for attr, value in entry["state"].items():
            assert value.dtype == live[attr].dtype and torch.equal(value, live[attr])
    assert decoded["callback_metrics"].keys() == captured["callback"].keys()
    odd = {
        "nan": torch.tensor(math.nan),
        "inf": torch.tensor([-math.inf, math.inf], dtype=torch.float64),
        "bf16": torch.tensor(1 / 3, dtype=torch.bfloat16),
        "big": torch.tensor(2**62 + 1),
        "flag": torch.tensor(True),
    }
    again = logged_format.decode(
        logged_format.encode({**decoded, "callback_metrics": odd, "epoch_open": True})
    )
    assert again is not None
    for name, value in odd.items():
        back = again["callback_metrics"][name]
        assert back.dtype == value.dtype and back.shape == value.shape
        assert torch.equal(back, value) or (name == "nan" and back.isnan().all())


def _mutations(stored: dict[str, Any]) -> list[Any]:
    """Hand edits of a stored capture: truncated, re-typed, emptied, nested wrongly."""
    text = stored["json"]
    document = json.loads(text)
    out: list[Any] = [
        None,
        [],
        "logged",
        {"version": 2},
        {"version": 2, "json": 5},
        {"version": 2, "json": text[: len(text) // 2]},
        {"version": 2, "json": "[" * 100_000},
        {"version": 2, "json": "[]"},
        {"version": True, "json": text},
        {"version": 1, "results": 5},
        {"version": 1, "results": ["x", 3, None, {"meta": []}]},
    ]
    for key in document:
        for bad in (None, 5, "x", [], {}, [1, [2]], {"a": {"dtype": "float32"}}):
            out.append({"version": 2, "json": json.dumps({**document, key: bad})})
    entry = document["results"][0]
    for key in entry:
        for bad in (
            None,
            -1,
            "x",
            [],
            {"value": {"dtype": "complex64", "shape": [], "values": [1]}},
        ):
            changed = {**document, "results": [{**entry, key: bad}, *document["results"][1:]]}
            out.append({"version": 2, "json": json.dumps(changed)})
    for key in entry["meta"]:
        for bad in (None, 7, "max", [], True):
            wrong = {**entry, "meta": {**entry["meta"], key: bad}}
            changed = {**document, "results": [wrong, *document["results"][1:]]}
            out.append({"version": 2, "json": json.dumps(changed)})
    shapes = {"dtype": "float32", "shape": [2, 2], "values": [1.0]}
    state = {**entry, "state": {"value": shapes}}
    out.append({"version": 2, "json": json.dumps({**document, "results": [state]})})
    return out


def test_a_hand_edited_or_truncated_capture_never_crashes_a_restore_or_a_fold(tmp_path) -> None:
    """Storage is not trusted: any edit of a stored capture (cut short, a field of another
    type, a tensor of another shape or an unknown dtype, nesting bombs) restores what is
    well-formed, and never raises in a restore or in a fold beside a good capture."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"], on_step=True, on_epoch=True, prog_bar=True)
            self.log("total", batch.sum(), reduce_fx="sum")
            return out

    done: dict[str, int] = {}

    class Attack(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx != 2:
                return
            good = logged.capture(trainer)
            mutations = _mutations(good)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for saved in mutations:
                    logged.restore(trainer, saved)
                    with contextlib.suppress(ValueError):  # none of them readable: said so
                        logged.fold([saved, good])
                    logged.fold([good, saved])
            assert logged.restore(trainer, good)  # and a good one still restores
            done["mutations"] = len(mutations)

    trainer = pl.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Attack()],
    )
    trainer.fit(Logs())
    assert done["mutations"] > 100


def test_a_hand_edited_capture_restores_what_it_can_and_warns(tmp_path) -> None:
    """Storage is not trusted: an entry Lightning would refuse (``on_step`` and ``on_epoch``
    both off) or that names nothing is left out with a warning, the rest comes back, and a
    capture of an unknown version changes nothing."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    good = _entry("total", "sum", {"value": 5.0})
    bad = _entry("bad", "sum", {"value": 1.0})
    bad["meta"] = {**_full_meta("bad", "sum"), "on_epoch": False}
    nameless = _entry("nameless", "sum", {"value": 1.0})
    del nameless["meta"]["fx"]
    good["meta"] = _full_meta("total", "sum")
    capture = _capture([good, bad, nameless], {"val_loss": 0.25})
    seen: dict[str, Any] = {}

    class Restore(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx != 1:  # the capture is of a batch inside an epoch, not its first
                return
            assert not logged.restore(trainer, {**capture, "version": 99})
            with pytest.warns(UserWarning, match="kept as 'bad', 'nameless' were not restored"):
                assert logged.restore(trainer, capture)
            results = trainer.fit_loop.epoch_loop._results
            seen["keys"] = list(results)
            seen["total"] = float(results["training_step.total"].value)
            seen["val_loss"] = float(trainer.callback_metrics["val_loss"])

    trainer = pl.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Restore()],
    )
    trainer.fit(BoringModel())
    assert seen == {"keys": ["training_step.total"], "total": 5.0, "val_loss": 0.25}


def _full_meta(name: str, reduce_fx: str) -> dict[str, Any]:
    return {
        "fx": "training_step",
        "name": name,
        "prog_bar": False,
        "logger": True,
        "on_step": False,
        "on_epoch": True,
        "reduce_fx": reduce_fx,
        "enable_graph": False,
        "add_dataloader_idx": True,
        "dataloader_idx": None,
        "metric_attribute": None,
        "sync_dist": False,
        "rank_zero_only": False,
        "sync_group": False,
    }
