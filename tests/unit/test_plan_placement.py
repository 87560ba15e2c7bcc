"""Which rank writes a replicated item (core/save/plan.py ``small_replicated_to_lowest``,
then DCP's deduplication): small ones and objects by the lowest rank holding them, up to a
budget; large ones balanced."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from lightning_elastic.core.save import plan as plan_mod
from lightning_elastic.core.save.plan import small_replicated_to_lowest


def tensor(fqn: str, nbytes: int) -> WriteItem:
    n = nbytes // 4
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([0])),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([n])),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([n]),
        ),
    )


def obj(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def writers(plans: list[SavePlan]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            out.setdefault(item.index.fqn, []).append(rank)
    return out


def test_small_replicated_items_and_objects_go_to_the_lowest_rank_large_ones_are_balanced():
    mib = 1 << 20
    replicated = [tensor(f"big{i}", 4 * mib) for i in range(4)]
    replicated += [tensor("norm", 4096), tensor("step", 4), obj("loops")]
    plans = [SavePlan([*replicated, tensor(f"shard{rank}", 2 * mib)]) for rank in range(3)]
    placed = small_replicated_to_lowest(plans)
    final = dedup_save_plans(placed)  # what DefaultSavePlanner.create_global_plan runs
    who = writers(final)
    assert all(len(ranks) == 1 for ranks in who.values()), who  # each written once
    assert who["norm"] == who["step"] == who["loops"] == [0]
    assert {who[f"shard{r}"][0] for r in range(3)} == {0, 1, 2}
    big = sorted(who[f"big{i}"][0] for i in range(4))
    assert len(set(big)) >= 2, who  # balanced over ranks, not all on rank 0


def test_the_lowest_rank_takes_small_items_only_up_to_the_budget(monkeypatch):
    monkeypatch.setattr(plan_mod, "SMALL_REPLICATED_BUDGET", 10_000)
    items = [tensor(f"t{i}", 4000) for i in range(6)]  # 24 kB of small items
    placed = small_replicated_to_lowest([SavePlan(items), SavePlan(items)])
    only_rank0 = {i.index.fqn for i in placed[0].items} - {i.index.fqn for i in placed[1].items}
    assert only_rank0 == {"t0", "t1"}  # 8 kB fit the 10 kB budget; the rest is balanced later
    assert small_replicated_to_lowest([SavePlan(items)])[0].items == items  # one rank: as is
