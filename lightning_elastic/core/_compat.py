"""Every private torch API the core relies on, each behind one named function.

After a torch upgrade, run ``tests/unit/test_compat.py``: it calls :func:`missing` and names
anything that moved. Tested with torch 2.6 - 2.13.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "REQUIREMENTS",
    "dcp_extension_registry",
    "dcp_zstd_available",
    "elastic_agent_class",
    "flatten_dense",
    "flatten_nested",
    "foreach_copy",
    "give_back_restart",
    "load_planner_mappings",
    "missing",
    "process_group_store",
    "read_dcp_directory",
    "rendezvous_round",
    "run_exit_handlers",
    "save_planner_state",
    "set_up_save_planner",
    "tcp_store_class",
    "torchrun_entry",
    "unmet",
    "version_counter",
]

# (module, attribute path): what each function below reaches into.
REQUIREMENTS: tuple[tuple[str, str], ...] = (
    # the c10d store behind a process group: our commit channel and arrival keys live there
    ("torch.distributed.distributed_c10d", "_get_process_group_store"),
    # DCP's stream extensions (zstd frames in shard files, ``stream.zstd/1`` descriptors)
    ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
    ("torch.distributed.checkpoint._extension", "ZStandard.is_available"),
    # DCP's flattening of a nested state into FQNs, as its planners flatten (a load's files are
    # planned without a planner: core/load/load.py files_to_read)
    ("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    # DefaultLoadPlanner keeps the flattening map and the caller's dict as attributes
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner.set_up_planner"),
    # DefaultSavePlanner keeps the flattened state, its map and its plan as attributes: a
    # reused plan sets them up without DCP's flattening (core/save/plan.py), and staging reads
    # plain tensors from the flattened state (core/save/stage.py)
    ("torch.distributed.checkpoint.default_planner", "DefaultSavePlanner.set_up_planner"),
    # reading a DCP directory of someone else's (``lightning-elastic import``): DCP's loader
    # without collectives, its state-rebuilding planner (which keeps the flattening map and
    # the caller's dict as attributes), its reader's metadata path and load id
    ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
    ("torch.distributed.checkpoint._traverse", "set_element"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader._get_metadata_path"),
    # many small tensors flattened in one C++ call (digests, core/save/digest.py), and
    # copied in one (staging, core/save/stage.py)
    ("torch._utils", "_flatten_dense_tensors"),
    ("torch", "_foreach_copy_"),
    # a tensor's in-place version counter (shared by its views): a lazy snapshot detects a
    # tensor changed between the save point and its copy (core/save/snapshot.py)
    ("torch", "Tensor._version"),
    # the launcher: torchrun's own argument parsing and run, with our agent class in place of
    # LocalElasticAgent (whose _monitor_workers it extends; SimpleElasticAgent keeps the
    # failure budget in the instance attribute _remaining_restarts, checked by the launcher
    # tests)
    ("torch.distributed.run", "get_args_parser"),
    ("torch.distributed.run", "config_from_args"),
    ("torch.distributed.run", "run"),
    # warm starts: torchrun's --run-path calls this module-level function in each worker; the
    # launcher puts its own runner in its place (looked up when torchrun builds the command)
    ("torch.distributed.run", "run_script_path"),
    ("torch.distributed.launcher.api", "LocalElasticAgent"),
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent._monitor_workers",
    ),
    # ... and its _start_workers, around which the launcher tells the workers the rendezvous
    # round (DynamicRendezvousHandler._state_holder.state.round, an instance attribute): the
    # agent's store outlives the workers, and a process group initialized in a new round
    # must not read the keys a previous round's workers left there
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent._start_workers",
    ),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "DynamicRendezvousHandler"),
    # the exit handlers a warm-started worker runs itself (it leaves through os._exit)
    ("atexit", "_run_exitfuncs"),
)


def rendezvous_round(handler: Any) -> int | None:
    """The round of torchrun's dynamic rendezvous ``handler`` (the same on every agent of a
    round), or ``None`` for another kind of handler."""
    holder = getattr(handler, "_state_holder", None)
    round_ = getattr(getattr(holder, "state", None), "round", None)
    return round_ if isinstance(round_, int) else None


def process_group_store(group: Any) -> Any:
    """The c10d ``Store`` of ``group`` (torch has no public accessor)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_process_group_store(group)


def dcp_extension_registry() -> Any:
    """DCP's registry of stream extensions, which decodes ``stream.zstd/1`` items."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    return ExtensionRegistry()


def dcp_zstd_available() -> bool:
    """Whether DCP's zstd stream extension can run (the ``zstandard`` package is present)."""
    from torch.distributed.checkpoint._extension import ZStandard

    return bool(ZStandard.is_available())


def flatten_nested(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``(FQN -> value, FQN -> original path)``: the nested ``state`` flattened as DCP's
    default planners flatten it."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    return flat, mappings


def load_planner_mappings(planner: Any) -> tuple[dict[str, Any], Any]:
    """``(flattened name -> original path, the caller's state dict)`` of a set-up
    ``DefaultLoadPlanner`` (its ``mappings`` and ``original_state_dict`` attributes)."""
    return planner.mappings, planner.original_state_dict


def set_up_save_planner(
    planner: Any, flat: dict[str, Any], mappings: dict[str, Any], is_coordinator: bool, plan: Any
) -> None:
    """Leave a ``DefaultSavePlanner`` as ``set_up_planner`` and ``create_local_plan`` would,
    from a flattening and a local plan made earlier for the same structure."""
    planner.state_dict, planner.mappings = flat, mappings
    planner.is_coordinator = is_coordinator
    planner.plan = plan


def save_planner_state(planner: Any) -> dict[str, Any] | None:
    """The flattened state (FQN -> value) of a set-up ``DefaultSavePlanner``."""
    state = getattr(planner, "state_dict", None)
    return state if isinstance(state, dict) else None


def read_dcp_directory(
    path: str,
    read_metadata: Callable[[Any], Any],
    load_object: Callable[[Any, str], Any],
) -> dict[str, Any]:
    """The whole state of a ``torch.distributed.checkpoint`` directory written by anyone, in
    this process, with DCP's own reader and its state-rebuilding planner (what
    ``dcp_to_torch_save`` does), except that its pickled ``.metadata`` is read by
    ``read_metadata(file)`` and every object (``BYTE_IO`` item) by ``load_object(buffer, fqn)``
    (DCP unpickles both with ``weights_only=False``). A failure raises the error itself, not
    DCP's ``CheckpointException`` (a ``BaseException``)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(where, "rb") as stream:
                metadata = read_metadata(stream)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            obj = load_object(value, fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    state: dict[str, Any] = {}
    planner = Planner()  # type: ignore[no-untyped-call]
    try:
        _load_state_dict(state, storage_reader=Reader(path), planner=planner, no_dist=True)
    except CheckpointException as exc:  # a BaseException: the first rank's error itself
        errors = [error for error, _ in exc.failures.values()]
        if errors and isinstance(errors[0], Exception):
            raise errors[0] from None
        raise RuntimeError(str(exc)) from None
    return state


def flatten_dense(tensors: list[Any]) -> Any:
    """One contiguous 1-D tensor holding ``tensors`` (same dtype) one after another."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)  # type: ignore[no-untyped-call]


def foreach_copy(targets: list[Any], sources: list[Any]) -> None:
    """``target.copy_(source)`` for every pair, in one call."""
    import torch

    torch._foreach_copy_(targets, sources)


def version_counter(tensor: Any) -> int:
    """How many in-place changes ``tensor`` (or a view of its data) has seen. Changes made
    through ``.data`` are not counted: autograd gives ``.data`` a counter of its own."""
    return int(tensor._version)


def torchrun_entry() -> tuple[Any, Any, Any]:
    """torchrun's argument parser (``get_args_parser()``), ``config_from_args(args)`` and
    ``run(args)`` (``torch.distributed.run``)."""
    from torch.distributed import run as torchrun

    return torchrun.get_args_parser(), torchrun.config_from_args, torchrun.run


def torchrun_script_runner(fn: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block, torchrun's ``--run-path`` runs the training script in each worker with
    ``fn(script, *args)`` instead of its ``run_script_path`` (``config_from_args`` looks the
    name up in its module at call time)."""
    return _swapped("torch.distributed.run", "run_script_path", fn)


def give_back_restart(agent: Any) -> int:
    """One more restart for a torch elastic agent (its loop spends one on every failed worker
    group: ``SimpleElasticAgent._remaining_restarts``, an instance attribute); the restarts
    left."""
    agent._remaining_restarts += 1
    return int(agent._remaining_restarts)


def run_exit_handlers() -> None:
    """Run (and clear) the ``atexit`` handlers now, as the interpreter does at its exit."""
    import atexit

    atexit._run_exitfuncs()


def tcp_store_class() -> Any:
    """c10d's ``TCPStore`` (public as ``torch.distributed.TCPStore``; older torch and the type
    stubs have it only in ``torch._C._distributed_c10d``)."""
    import torch.distributed as dist

    store = getattr(dist, "TCPStore", None)
    if store is None:  # pragma: no cover - torch < 2.0
        from torch._C._distributed_c10d import TCPStore as store
    return store


def elastic_agent_class(cls: type) -> contextlib.AbstractContextManager[None]:
    """Within the block, torchrun's launcher builds its agent from ``cls`` instead of
    ``LocalElasticAgent`` (``launch_agent`` looks the name up in its module at call time)."""
    return _swapped("torch.distributed.launcher.api", "LocalElasticAgent", cls)


@contextlib.contextmanager
def _swapped(module_name: str, name: str, value: Any) -> Iterator[None]:
    """Within the block, ``module_name.name`` is ``value``."""
    module: Any = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def missing() -> list[str]:
    """The requirements of this module this installation no longer meets."""
    return unmet(REQUIREMENTS)


def unmet(requirements: tuple[tuple[str, str], ...]) -> list[str]:
    """The ``(module, attribute path)`` pairs that do not resolve, as ``module:attribute``."""
    gone = []
    for module_name, attribute in requirements:
        try:
            node: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                node = getattr(node, part)
        except (ImportError, AttributeError):
            gone.append(f"{module_name}:{attribute}")
    return gone
