"""Which LitData objects a dataloader reads, and whether they read this rank's samples.

A LitData ``StreamingDataset`` decides its rank and world size when it is built: from the
process group, or, before one exists (at module level, in ``__init__``), from ``GLOBAL_RANK``
(which torchrun and Lightning's own launcher do not set: every rank reads as rank 0) and
``WORLD_SIZE`` (which Lightning's launcher sets only after rank 0 started).
:func:`check_ranks` finds such a dataset in any stage's dataloader at setup: fixed when only
its rank is wrong, refused (:class:`~lightning_elastic.errors.DataShardingError`, on every
rank) otherwise.

Which rank calls what: every rank calls :func:`check_ranks` for every dataloader Lightning
sets up, in the same order (one all-reduce on the strategy's group when a LitData dataset is
there). LitData is not imported unless the dataloader holds one of its datasets.

LitData internals relied on (tested with 0.2.76): ``StreamingDataset.distributed_env`` and
``input_dir``, ``_datasets`` of its combining datasets, ``litdata.utilities.env._DistributedEnv``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_elastic.errors import DataShardingError
from lightning_elastic.lightning._compat import litdata_children

__all__ = ["check_ranks", "is_streaming_loader", "streaming_datasets"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- what is LitData's


def _from_litdata(obj: object, name: str) -> bool:
    return any(
        cls.__name__ == name and cls.__module__.startswith("litdata.") for cls in type(obj).__mro__
    )


def is_streaming_loader(loader: object) -> bool:
    """Whether ``loader`` is LitData's ``StreamingDataLoader`` (or a subclass); LitData is not
    imported to find out."""
    return _from_litdata(loader, "StreamingDataLoader")


def streaming_datasets(dataset: object) -> list[Any]:
    """The LitData ``StreamingDataset`` objects ``dataset`` reads from: itself, or those a
    ``CombinedStreamingDataset`` / ``ParallelStreamingDataset`` combines."""
    if _from_litdata(dataset, "StreamingDataset"):
        return [dataset]
    children = litdata_children(dataset)
    if not type(dataset).__module__.startswith("litdata.") or not isinstance(children, list):
        return []
    return [child for c in children for child in streaming_datasets(c)]


# ---------------------------------------------------------------------- ranks


def check_ranks(
    loader: object,
    *,
    rank: int,
    replicas: int,
    all_agree: Callable[[bool], bool],
    hook: str = "train_dataloader()",
) -> None:
    """Make every LitData dataset of a ``loader`` read as ``rank`` of ``replicas``.

    A dataset built before the process group existed read its rank from ``GLOBAL_RANK`` (unset
    under torchrun and Lightning's own launcher: rank 0) and its world size from
    ``WORLD_SIZE``. Only the rank wrong: fixed, with a warning (LitData decided nothing else
    from it). The world size wrong as well (Lightning's launcher sets ``WORLD_SIZE`` after rank
    0 started): refused on every rank, since LitData also chose ``drop_last`` from it. A
    dataset that shards over every process of the group while the strategy trains fewer
    data-parallel replicas (model parallelism) is refused too, saying so.

    ``all_agree(ok)`` is True when ``ok`` on every rank (a collective: every rank calls this
    with the same kind of loader); ``hook`` is where the loader is built (the message says to
    build the dataset there).

    Raises:
        DataShardingError: a dataset was set up for another world size (on every rank).
    """
    datasets = streaming_datasets(getattr(loader, "dataset", None))
    if not datasets:
        return
    from litdata.utilities.env import _DistributedEnv

    problem, wrong_rank = None, []
    for dataset in datasets:
        env = dataset.distributed_env
        if (env.world_size, env.global_rank) == (replicas, rank):
            continue
        if env.world_size != replicas:
            where = dataset.input_dir.path or dataset.input_dir.url
            problem = _world_problem(where, env, rank, replicas, _DistributedEnv.detect(), hook)
        else:
            wrong_rank.append(dataset)
    if not all_agree(problem is None):  # nothing is fixed (or said fixed) when the fit stops
        raise DataShardingError(
            problem
            or "another rank's LitData StreamingDataset was set up for another world (see "
            "that rank's error)"
        )
    for dataset in wrong_rank:
        env = dataset.distributed_env
        # its node count stays: it decides the shuffle, and every rank built it the same way
        dataset.distributed_env = _DistributedEnv(replicas, rank, env.num_nodes)
        log.warning(
            "the LitData StreamingDataset of %s was set up before the process group existed "
            "and would have read rank %d's samples on rank %d: it now reads rank %d's. Build "
            "it in %s or LightningDataModule.setup() (LitData reads the rank from "
            "GLOBAL_RANK, which torchrun does not set, until the process group exists).",
            dataset.input_dir.path or dataset.input_dir.url,
            env.global_rank,
            rank,
            rank,
            hook,
        )


def _world_problem(where: Any, env: Any, rank: int, replicas: int, now: Any, hook: str) -> str:
    """Why a dataset set up for ``env.world_size`` ranks cannot be read by ``replicas``."""
    same = (env.world_size, env.global_rank) == (now.world_size, now.global_rank)
    if same and now.world_size > replicas:
        # built where the process group exists: it shards over all of it, more than replicas
        return (
            f"the LitData StreamingDataset of {where} shards over all {env.world_size} "
            f"processes (this is process {env.global_rank}), but the strategy trains "
            f"{replicas} data-parallel replica(s) (rank {rank}): with model parallelism the "
            "processes of one replica must read the same samples, and LitData takes its rank "
            "and world size from the whole process group. Use a strategy without model "
            "parallelism, or a map-style dataset, whose sampler the strategy shards."
        )
    return (
        f"the LitData StreamingDataset of {where} was set up for a world of "
        f"{env.world_size} (rank {env.global_rank}) and is read by rank {rank} of {replicas}: "
        "it was built before the process group existed (LitData then reads the world size "
        "from WORLD_SIZE and the rank from GLOBAL_RANK, and chooses drop_last from them). "
        f"Build the StreamingDataset in {hook} or in LightningDataModule.setup(), where the "
        "process group exists."
    )
