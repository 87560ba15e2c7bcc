"""``lightning-elastic import``: a Lightning ``.ckpt`` or a DCP directory into our format,
verified and read safely; and the way back (``consolidate``) to a file Lightning loads: a run
moves to us and away from us without retraining. One process."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_elastic import (
    ElasticCheckpointIO,
    UnsafeCheckpointError,
    consolidate,
    import_checkpoint,
)
from lightning_elastic.cli import main
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from tests.lightning.models import TinyModule, make_trainer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:The '\\w+_dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed from"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninit"),
]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fit(root: Path, max_steps: int, *, ours: bool = False, ckpt_path: Any = None) -> TinyModule:
    pl.seed_everything(5, verbose=False)
    model = TinyModule(n=16, hidden=8)
    trainer = make_trainer(
        str(root),
        max_steps=max_steps,
        strategy="auto",
        devices=1,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=3)],
        plugins=[ElasticCheckpointIO()] if ours else None,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_run_moves_to_us_and_back_without_retraining(tmp_path: Path, capsys) -> None:
    fit(tmp_path / "lightning", 3)  # Lightning's own .ckpt at step 3
    source = tmp_path / "lightning" / "ckpts" / "epoch=0-step=3.ckpt"
    code, out, _ = run(capsys, "import", str(source), str(tmp_path / "ours"), "--json")
    assert code == 0, out
    imported = json.loads(out)
    directory = tmp_path / "ours" / "epoch=0-step=3.ckpt"
    assert imported["location"] == str(directory) and imported["step"] == 3
    assert (directory / MANIFEST_FILE).is_file()
    assert same(consolidate(directory), torch.load(source, weights_only=False))
    # to us: resumed from the imported directory, as from the file
    theirs = fit(tmp_path / "a", 7, ckpt_path=str(source)).state_dict()
    ours = fit(tmp_path / "b", 7, ours=True, ckpt_path=str(directory)).state_dict()
    assert same(ours, theirs)
    # and back: consolidated to one file, which a plain Trainer resumes from
    out_file = tmp_path / "back.ckpt"
    assert run(capsys, "consolidate", str(directory), str(out_file))[0] == 0
    assert torch.load(out_file, weights_only=True)["global_step"] == 3
    assert same(fit(tmp_path / "c", 7, ckpt_path=str(out_file)).state_dict(), theirs)


def test_a_dcp_directory_is_imported_with_its_objects(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 5,
        "note": {"lr": 0.1, "tags": ["a", "b"]},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = import_checkpoint(tmp_path / "dcp", tmp_path / "ours", name="five")
    assert result.kind == "torch.distributed.checkpoint directory" and result.step == 5
    back = consolidate(tmp_path / "ours" / "five")
    assert same(back, state)  # the optimizer's state keyed by int again, as it was saved
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(back["optimizer"])
    assert torch.equal(
        fresh.state_dict()["state"][0]["exp_avg"], optimizer.state[model.weight]["exp_avg"]
    )


def test_lightnings_sharded_layout_becomes_its_checkpoint_dict(tmp_path: Path) -> None:
    """FSDPStrategy / ModelParallelStrategy(save_distributed_checkpoint=True) write the model
    and each optimizer with DCP and the rest of the checkpoint as ``meta.pt``."""
    model = torch.nn.Linear(4, 3)
    sharded = tmp_path / "epoch=1-step=8.ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(sharded), no_dist=True)
    torch.save({"global_step": 8, "epoch": 1, "loops": {"fit_loop": {}}}, sharded / "meta.pt")
    result = import_checkpoint(sharded, tmp_path / "ours")
    back = consolidate(result.location)
    assert result.step == 8 and back["epoch"] == 1 and back["loops"] == {"fit_loop": {}}
    assert same(back["state_dict"], model.state_dict()) and "model" not in back


@dataclasses.dataclass
class Custom:
    """A class no allowlist knows."""

    value: int = 1


def test_a_source_whose_objects_would_run_code_is_refused_unless_trusted(
    tmp_path: Path, capsys
) -> None:
    source = tmp_path / "custom.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "extra": Custom()}, source)
    code, _, err = run(capsys, "import", str(source), str(tmp_path / "ours"))
    assert code == 2 and "Custom" in err and "trusted" in err
    assert not (tmp_path / "ours" / "custom.ckpt").exists()
    code, out, _ = run(capsys, "import", str(source), str(tmp_path / "ours"), "--trusted")
    assert code == 0 and "verified" in out


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch hacked",))


def test_a_dcp_metadata_pickle_that_would_run_code_is_refused_without_running_it(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    buffer = io.BytesIO()
    pickle.dump(_Boom(), buffer)
    (tmp_path / "dcp" / ".metadata").write_bytes(buffer.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="system"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "ours")
    assert not (tmp_path / "hacked").exists()


def test_a_path_that_is_no_checkpoint_is_a_usage_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "plain").mkdir()
    code, _, err = run(capsys, "import", str(tmp_path / "plain"), str(tmp_path / "ours"))
    assert code == 2 and "neither a torch.save file nor" in err
    code, _, err = run(capsys, "import", str(tmp_path / "missing.ckpt"), str(tmp_path / "o"))
    assert code == 2


def test_hostile_a_garbled_source_is_a_corrupt_checkpoint_naming_the_file(
    tmp_path: Path, capsys
) -> None:
    """Not "unsafe" (--trusted would not help) nor an unexpected error: exit 1, the file named."""
    torch.save({"w": torch.ones(64), "global_step": 1}, tmp_path / "good.ckpt")
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "half.ckpt").write_bytes(data[: len(data) // 2])
    dcp.save({"w": torch.ones(64)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "dcp" / ".metadata").write_bytes(b"garbage")
    for source, file in (("half.ckpt", "half.ckpt"), ("dcp", ".metadata")):
        code, _, err = run(capsys, "import", str(tmp_path / source), str(tmp_path / "ours"))
        assert code == 1 and f"'{file}'" in err and "corrupt" in err, err
    assert not (tmp_path / "ours").exists() or not any((tmp_path / "ours").iterdir())


def test_hostile_an_import_never_empties_a_folder_of_that_name(tmp_path: Path, capsys) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "model.ckpt")
    folder = tmp_path / "ours" / "model.ckpt"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "import", str(tmp_path / "model.ckpt"), str(tmp_path / "ours"))
    assert code == 2 and "not a checkpoint of ours" in err
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    code, _, err = run(
        capsys, "import", str(tmp_path / "model.ckpt"), str(tmp_path / "ours"), "--name", "m"
    )
    assert code == 0
    code, _, err = run(
        capsys, "import", str(tmp_path / "model.ckpt"), str(tmp_path / "ours"), "--name", "m"
    )
    assert code == 2 and "--overwrite" in err
