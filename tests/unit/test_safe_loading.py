"""Loading never runs code from storage: objects are unpickled with ``weights_only=True`` and an
allowlist; ``trusted=True`` is the explicit, logged opt-in. One process, through the engine."""

from __future__ import annotations

import collections
import datetime
import io
import logging
import pathlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_elastic import CheckpointEngine
from lightning_elastic.core.elastic import rng
from lightning_elastic.core.format.dcp_json import read_checkpoint_metadata
from lightning_elastic.core.load.load import (
    _dcp_load,
    _LoadPlanner,
    load_checkpoint,
    read_full_state,
    read_rank_states,
)
from lightning_elastic.core.load.reader import ShardReader
from lightning_elastic.core.load.safe import (
    ALLOWED_GLOBALS,
    UnsafeObjectError,
    load_object,
)
from lightning_elastic.errors import CheckpointLoadError, UnsafeCheckpointError

PAYLOAD = f"{__name__}._write_marker"


def _write_marker(path: str) -> str:
    """What a malicious pickle would run: here it only leaves a file behind."""
    Path(path).write_text("pwned")
    return "payload ran"


class Payload:
    """Pickles to a call of :func:`_write_marker` (``__reduce__``), as a crafted object would."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_write_marker, (self.marker,))


@pytest.fixture
def engine(tmp_path):
    eng = CheckpointEngine(tmp_path / "ckpts")
    yield eng
    eng.close()


def _pickled(obj: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


# ------------------------------------------------------------------ a crafted checkpoint


def _save_payload(engine: CheckpointEngine, marker: Path) -> None:
    # written by our own writer: checksums are right and verification passes
    state = {"model": {"w": torch.ones(3)}, "callbacks": {"evil": {"x": Payload(marker)}}}
    engine.save(state, step=1, rank_state={"metrics": {"m": Payload(marker)}}).result()


def test_crafted_object_is_refused_by_default_and_nothing_runs(engine, tmp_path) -> None:
    marker = tmp_path / "marker"
    _save_payload(engine, marker)
    with pytest.raises(UnsafeCheckpointError) as caught:
        engine.load()
    err = caught.value
    assert isinstance(err, CheckpointLoadError)  # existing `except CheckpointLoadError` holds
    assert err.types == (PAYLOAD,)
    assert PAYLOAD in str(err) and "callbacks.evil.x" in str(err)
    assert "trusted=True" in str(err) and "--trusted" in str(err)
    assert "step_000000001" in str(err)
    assert not marker.exists()


def test_crafted_object_is_refused_with_a_template_too(engine, tmp_path) -> None:
    marker = tmp_path / "marker"
    _save_payload(engine, marker)
    template = {"model": {"w": torch.zeros(3)}, "callbacks": {"evil": {"x": None}}}
    with pytest.raises(UnsafeCheckpointError):
        engine.load(template)
    assert template["callbacks"]["evil"]["x"] is None and not marker.exists()


def test_rank_states_and_full_state_are_refused_too(engine, tmp_path) -> None:
    marker = tmp_path / "marker"
    _save_payload(engine, marker)
    info = engine.latest()
    assert info is not None
    with pytest.raises(UnsafeCheckpointError, match=r"__rank_local__\.0\.metrics\.m"):
        read_rank_states(engine.storage, info, "metrics")
    with pytest.raises(UnsafeCheckpointError):
        read_full_state(engine.storage.child(info.name))
    assert not marker.exists()


def test_dcp_non_flattened_branch_is_safe_too(engine, tmp_path) -> None:
    marker = tmp_path / "marker"
    engine.save({"evil": Payload(marker), "w": torch.ones(2)}, step=1).result()
    info = engine.latest()
    assert info is not None
    ckpt = engine.storage.child(info.name)
    metadata, _ = read_checkpoint_metadata(ckpt)
    state = {"evil": None, "w": torch.zeros(2)}
    planner = _LoadPlanner(flatten_state_dict=False)
    with pytest.raises(UnsafeCheckpointError, match=PAYLOAD):
        _dcp_load(state, ShardReader(ckpt, metadata), planner, engine.coordinator, info)
    assert not marker.exists()
    trusted = _LoadPlanner(flatten_state_dict=False, trusted=True)
    _dcp_load(state, ShardReader(ckpt, metadata), trusted, engine.coordinator, info)
    # (DCP's load hands the planner a copy of a plain dict: the object lands there)
    assert trusted.state_dict["evil"] == "payload ran" and marker.exists()


def test_trusted_load_runs_the_pickle_and_warns_once(engine, tmp_path, caplog) -> None:
    marker = tmp_path / "marker"
    _save_payload(engine, marker)
    info = engine.latest()
    assert info is not None
    with caplog.at_level(logging.WARNING, logger="lightning_elastic.core.load.safe"):
        result = load_checkpoint(engine.storage, engine.coordinator, info, None, trusted=True)
        load_checkpoint(engine.storage, engine.coordinator, info, None, trusted=True)
        per_rank = read_rank_states(engine.storage, info, "metrics", trusted=True)
    assert result.state is not None and result.state["callbacks"]["evil"]["x"] == "payload ran"
    assert result.rank_state == {"metrics": {"m": "payload ran"}}
    assert per_rank == {0: {"m": "payload ran"}}
    assert marker.exists()
    warnings = [r for r in caplog.records if "trusted=True" in r.getMessage()]
    assert len(warnings) == 1 and info.location in warnings[0].getMessage()


def test_unsafe_error_survives_pickling_between_ranks() -> None:
    import pickle

    inner = pickle.loads(pickle.dumps(UnsafeObjectError("a.b", ["x.Y"])))
    assert inner.fqn == "a.b" and inner.types == ("x.Y",) and "x.Y" in str(inner)
    outer = UnsafeCheckpointError("ckpt", [], ["x.Y"])
    again = pickle.loads(pickle.dumps(outer))
    assert type(again) is UnsafeCheckpointError and again.types == ("x.Y",)
    assert str(again) == str(outer) and "trusted=True" in str(again)


def test_a_refused_global_is_found_before_anything_is_unpickled(tmp_path) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(UnsafeObjectError) as caught:
        load_object(_pickled({"ok": [1, 2], "bad": Payload(marker)}), "x")
    assert caught.value.types == (PAYLOAD,) and not marker.exists()


def test_not_a_torch_save_archive_is_refused() -> None:
    import pickle

    with pytest.raises(UnsafeObjectError, match=r"not a torch\.save archive"):
        load_object(io.BytesIO(pickle.dumps([1, 2])), "x")


def test_non_empty_dict_subclass_inside_a_value_fails_typed() -> None:
    # torch's weights_only unpickler fills exact dicts only; such values are rare because
    # mappings are flattened by the engine (only those inside tuples/objects are pickled)
    value = (collections.defaultdict(list, {"a": [1]}),)
    with pytest.raises(UnsafeObjectError, match="defaultdict"):
        load_object(_pickled(value), "x")


def test_safe_loading_leaves_torch_allowlist_as_it_was() -> None:
    torch.serialization.add_safe_globals([np.dtype])  # the user's own entry, also ours
    try:
        before = set(torch.serialization.get_safe_globals())
        loaded = load_object(_pickled(np.random.get_state()), "rng")
        assert loaded[0] == "MT19937"
        assert set(torch.serialization.get_safe_globals()) == before
    finally:
        torch.serialization.clear_safe_globals()


def test_user_allowlisted_type_loads() -> None:
    value = (datetime.timedelta(seconds=3), Payload("unused"))
    with pytest.raises(UnsafeObjectError):
        load_object(_pickled(value), "x")
    # allowlisting the class does not allowlist what its __reduce__ calls
    with torch.serialization.safe_globals([Payload]), pytest.raises(UnsafeObjectError):
        load_object(_pickled(value), "x")


def test_allowlist_names_only_resolvable_data_types() -> None:
    from lightning_elastic.core.load.safe import _resolve

    for name in ALLOWED_GLOBALS:
        if name.startswith("numpy.core."):
            continue  # numpy 1 name, resolved to numpy._core here
        for obj, pickled_name in _resolve(name):
            assert callable(obj) or obj is Any, name
            assert pickled_name


# ------------------------------------------------------------------ what Lightning saves


def _lr_schedulers() -> list[dict[str, Any]]:
    lr = torch.optim.lr_scheduler

    def opt() -> torch.optim.Optimizer:
        return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    schedulers: list[Any] = [
        lr.ReduceLROnPlateau(opt(), patience=1),
        lr.OneCycleLR(opt(), max_lr=0.1, total_steps=10),
        lr.LambdaLR(opt(), lambda step: 0.9**step),
        lr.StepLR(opt(), step_size=2),
        lr.MultiStepLR(opt(), milestones=[1, 3]),  # milestones: a Counter
        lr.CosineAnnealingWarmRestarts(opt(), T_0=3),
        lr.CyclicLR(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), 0.01, 0.1),
        lr.LinearLR(opt()),
        lr.PolynomialLR(opt()),
    ]
    o = opt()
    schedulers.append(lr.SequentialLR(o, [lr.LinearLR(o), lr.ExponentialLR(o, 0.9)], [2]))
    for sched in schedulers:
        sched.optimizer.step()
        if isinstance(sched, lr.ReduceLROnPlateau):
            sched.step(1.0)
        else:
            sched.step()
    return [s.state_dict() for s in schedulers]


def _lightning_like_state(tmp_path: Path) -> dict[str, Any]:
    import torchmetrics
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    mean, cat = torchmetrics.MeanMetric(), torchmetrics.CatMetric()
    mean.update(torch.tensor([1.0, 2.0]))
    cat.update(torch.tensor([3.0]))
    early = EarlyStopping(monitor="loss")
    early.wait_count = 2
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "mc", monitor="loss")
    cfg = OmegaConf.create({"lr": 0.1, "layers": [8, {"width": 4}], "data": {"name": "x"}})
    random.seed(3)
    np.random.seed(3)
    return {
        "epoch": 1,
        "global_step": 12,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {**model.state_dict(), **{f"m.{k}": v for k, v in mean.state_dict().items()}},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {
            "EarlyStopping{'monitor': 'loss', 'mode': 'min'}": early.state_dict(),
            "ModelCheckpoint{'monitor': 'loss'}": checkpoint.state_dict(),
        },
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": _lr_schedulers(),
        "hparams_name": "cfg",
        "hyper_parameters": cfg,  # a DictConfig (a Mapping: flattened, its lists pickled)
        "hparams_type": DictConfig,
        "metrics": {"cat": cat.metric_state, "mean": mean.metric_state},
        # values that are pickled whole (tuples are leaves): the plain types states hold
        "misc": (
            datetime.timedelta(minutes=5),
            datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc),
            pathlib.Path("/data/run"),
            np.float64(0.25),
            np.int64(7),
            np.arange(3, dtype=np.int16),
            collections.OrderedDict(a=1),
            collections.Counter("aab"),
            collections.defaultdict(list),
            {1, 2},
            frozenset({3}),
            1 + 2j,
            b"raw",
            ListConfig([1, "two"]),
            torch.float16,
            torch.device("cpu"),
            torch.Size([2, 3]),
        ),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (DictConfig, ListConfig)):
        return type(a) is type(b) and OmegaConf.to_container(a) == OmegaConf.to_container(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def test_lightning_like_state_round_trips_with_safe_loading(engine, tmp_path) -> None:
    state = _lightning_like_state(tmp_path)
    captured = rng.capture()
    engine.save(state, step=12, rank_state={"rng": captured}).result()
    result = engine.load()
    loaded = result.state
    assert loaded is not None
    cfg = state.pop("hyper_parameters")
    hparams = loaded.pop("hyper_parameters")  # the engine flattens the DictConfig (a Mapping)
    assert hparams["lr"] == 0.1 and hparams["data"] == {"name": "x"}
    assert _same(cfg.layers, hparams["layers"])  # its ListConfig is pickled whole
    for key in state:
        assert _same(state[key], loaded[key]), key
    assert result.rank_state is not None
    saved_rng = result.rank_state["rng"]
    assert saved_rng.keys() == captured.keys() and _same(captured["numpy"], saved_rng["numpy"])
    rng.restore(saved_rng)  # the loaded states are usable as they are
    for sched, data in zip(_lr_schedulers(), loaded["lr_schedulers"], strict=True):
        assert sched.keys() == data.keys()


def test_numpy_1_names_resolve_under_numpy_2_without_warnings() -> None:
    # a checkpoint written under numpy 1 names numpy.core.multiarray._reconstruct; on numpy 2
    # that module warns when imported (warnings are errors here)
    from lightning_elastic.core.load.safe import _resolve

    (obj, name), *_ = _resolve("numpy.core.multiarray._reconstruct")
    assert name == "numpy.core.multiarray._reconstruct" and obj.__name__ == "_reconstruct"
    loaded = load_object(_pickled(np.arange(4, dtype=np.uint32)), "x")
    assert loaded.dtype == np.uint32 and loaded.tolist() == [0, 1, 2, 3]
