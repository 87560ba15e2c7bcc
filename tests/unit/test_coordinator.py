"""Coordinator in one process: collectives, failure propagation and the classification of a
failed collective (timeout naming the absent ranks vs. this rank's own failure)."""

import pickle
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_elastic.core.dist.coordinator import Coordinator, _Failed, _lost_peer
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    DistributedFailure,
    IntegrityError,
    LoadTimeoutError,
    Phase,
    SaveTimeoutError,
    StorageError,
)

TIMEOUT = timedelta(seconds=7)


class Unpicklable(Exception):
    """An exception that cannot travel: it holds a lambda."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.callback = lambda: None


class NeedsTwoArgs(Exception):
    """Pickles, but does not unpickle (its ``__init__`` wants two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def raiser(exc: Exception):
    def fn(*_args):
        raise exc

    return fn


def pair(world_size: int = 2) -> list[Coordinator]:
    """``world_size`` coordinators sharing one store and namespace (no process group: the
    collectives under test are called directly through ``_collective``)."""
    store = dist.HashStore()
    coords = []
    for rank in range(world_size):
        coord = Coordinator(
            rank=rank,
            world_size=world_size,
            group=None,
            store=store,
            timeout=TIMEOUT,
            namespace="test/ns",
        )
        coord.group = object()  # looks distributed; never used by ``_collective`` itself
        coords.append(coord)
    return coords


def arrived(coord: Coordinator, seq: int, rank: int) -> bool:
    return coord.store.check([coord.key("arrive", seq, rank)])


# ---------------------------------------------------------------- single process


@pytest.fixture
def single() -> Coordinator:
    return Coordinator.single_process(timeout=TIMEOUT)


def test_single_process_coordinator_is_rank_zero_of_one_and_not_distributed(single) -> None:
    assert (single.rank, single.world_size, single.group) == (0, 1, None)
    assert single.is_coordinator and not single.distributed
    assert single.timeout == TIMEOUT


def test_each_coordinator_gets_its_own_store_namespace() -> None:
    a, b = Coordinator.single_process(), Coordinator.single_process()
    assert a.namespace != b.namespace
    assert a.namespace.startswith("lightning_elastic/")
    assert a.key("commit", 3) == f"{a.namespace}/commit/3"


def test_gather_scatter_hands_rank_zero_the_first_output_of_global_fn(single) -> None:
    seen = []

    def global_fn(values):
        seen.append(list(values))
        return [v * 10 for v in values]

    assert single.gather_scatter(Phase.SAVE_PLAN, lambda: 4, global_fn) == 40
    assert seen == [[4]]


def test_all_gather_returns_the_list_of_local_results(single) -> None:
    assert single.all_gather(Phase.AGREE, lambda: {"rank": 0}) == [{"rank": 0}]


def test_broadcast_returns_rank_zeros_value(single) -> None:
    assert single.broadcast(Phase.INIT, lambda: "run-1234") == "run-1234"


def test_max_ints_and_all_pass_values_through_in_one_process(single) -> None:
    assert single.max_ints([3, 0, 9]) == [3, 0, 9]
    assert single.max_ints((), track=False) == []
    assert single.all(True) is True
    assert single.all(False) is False


def test_single_process_collectives_leave_no_arrival_keys(single) -> None:
    single.broadcast(Phase.INIT, lambda: 1)
    single.max_ints([1])
    assert single._seq == 0  # nothing tracked without a group


# ---------------------------------------------------------------- failure propagation


@pytest.mark.parametrize(
    "call",
    [
        lambda c, fn: c.gather_scatter(Phase.SAVE_PLAN, fn, lambda v: v, error=CheckpointSaveError),
        lambda c, fn: c.all_gather(Phase.SAVE_PLAN, fn, error=CheckpointSaveError),
        lambda c, fn: c.broadcast(Phase.SAVE_PLAN, fn, error=CheckpointSaveError),
    ],
    ids=["gather_scatter", "all_gather", "broadcast"],
)
def test_a_typed_cause_is_reraised_as_is(single, call) -> None:
    with pytest.raises(StorageError) as info:
        call(single, raiser(StorageError("write", "mem://x/shard", "disk on fire")))
    assert type(info.value) is StorageError
    assert (info.value.op, info.value.path) == ("write", "mem://x/shard")
    assert "disk on fire" in str(info.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda c, fn: c.gather_scatter(Phase.SAVE_PLAN, fn, lambda v: v, error=CheckpointSaveError),
        lambda c, fn: c.all_gather(Phase.SAVE_PLAN, fn, error=CheckpointSaveError),
        lambda c, fn: c.broadcast(Phase.SAVE_PLAN, fn, error=CheckpointSaveError),
    ],
    ids=["gather_scatter", "all_gather", "broadcast"],
)
def test_an_untyped_failure_becomes_the_callers_error_naming_the_rank(single, call) -> None:
    with pytest.raises(CheckpointSaveError) as info:
        call(single, raiser(ValueError("bad shape")))
    assert type(info.value) is CheckpointSaveError
    assert info.value.failed_ranks == [0]
    failure = info.value.failures[0]
    assert (failure.phase, failure.error_type, failure.message) == (
        "save/plan",
        "ValueError",
        "bad shape",
    )


def test_a_failing_global_fn_reaches_every_rank_as_the_callers_error(single) -> None:
    with pytest.raises(CheckpointLoadError) as info:
        single.gather_scatter(
            Phase.LOAD, lambda: 1, raiser(KeyError("planner")), error=CheckpointLoadError
        )
    assert info.value.failed_ranks == [0]
    assert info.value.failures[0].error_type == "KeyError"


def test_global_fn_is_not_run_when_a_local_fn_failed(single) -> None:
    ran = []
    with pytest.raises(CheckpointSaveError):
        single.gather_scatter(
            Phase.SAVE_PLAN,
            raiser(ValueError("x")),
            lambda v: ran.append(v) or v,
            error=CheckpointSaveError,
        )
    assert ran == []


def test_a_single_distributed_failure_is_reraised_unchanged(single) -> None:
    cause = SaveTimeoutError("ckpt", Phase.COMMIT, [3], 5.0)
    with pytest.raises(SaveTimeoutError) as info:
        single.broadcast(Phase.COMMIT, raiser(cause), error=CheckpointLoadError)
    assert info.value.missing_ranks == [3] and info.value.timeout_s == 5.0


def test_an_exception_that_does_not_pickle_still_names_rank_and_type(single) -> None:
    with pytest.raises(CheckpointSaveError) as info:
        single.all_gather(
            Phase.WRITE, raiser(Unpicklable("holds a lambda")), error=CheckpointSaveError
        )
    assert type(info.value) is CheckpointSaveError
    assert info.value.failures[0].error_type == "Unpicklable"
    assert "holds a lambda" in str(info.value)


def test_an_exception_that_does_not_unpickle_becomes_the_callers_error() -> None:
    failed = _Failed(1, Phase.WRITE, NeedsTwoArgs("a", "b"))
    assert failed.blob is not None and failed.exception() is None
    coord = Coordinator.single_process()
    with pytest.raises(CheckpointSaveError) as info:
        coord._raise_failures(Phase.WRITE, failed, "ckpt", CheckpointSaveError)
    assert info.value.failed_ranks == [1]
    assert info.value.failures[1].message == "a/b"


def test_the_same_typed_cause_on_two_ranks_is_reraised_as_rank_zeros() -> None:
    coord = Coordinator.single_process()
    failed = [
        _Failed(1, Phase.LOAD_VERIFY, IntegrityError("ckpt", "b.distcp", "checksum")),
        _Failed(0, Phase.LOAD_VERIFY, IntegrityError("ckpt", "a.distcp", "size")),
    ]
    with pytest.raises(IntegrityError) as info:
        coord._raise_failures(Phase.LOAD_VERIFY, failed, "ckpt", CheckpointLoadError)
    assert info.value.file == "a.distcp"  # sorted by rank


def test_mixed_failures_become_the_callers_error_naming_every_rank() -> None:
    coord = Coordinator.single_process()
    failed = [
        _Failed(2, Phase.WRITE, ValueError("two")),
        _Failed(0, Phase.WRITE, StorageError("write", "p", "zero")),
    ]
    with pytest.raises(CheckpointSaveError) as info:
        coord._raise_failures(Phase.WRITE, failed, "ckpt-7", CheckpointSaveError)
    assert type(info.value) is CheckpointSaveError
    assert info.value.failed_ranks == [0, 2]
    assert info.value.failures[0].error_type == "StorageError"
    assert info.value.failures[2].error_type == "ValueError"
    assert "ckpt-7" in str(info.value) and "rank(s) 0, 2" in str(info.value)


def test_two_distributed_failures_are_wrapped_not_reraised() -> None:
    coord = Coordinator.single_process()
    failed = [
        _Failed(0, Phase.COMMIT, CheckpointSaveError("c", [])),
        _Failed(1, Phase.COMMIT, CheckpointSaveError("c", [])),
    ]
    with pytest.raises(CheckpointLoadError) as info:
        coord._raise_failures(Phase.COMMIT, failed, "c", CheckpointLoadError)
    assert info.value.failed_ranks == [0, 1]


def test_plain_values_and_empty_lists_are_not_failures() -> None:
    coord = Coordinator.single_process()
    for value in (None, [], [1, 2], "x", {"a": 1}):
        coord._raise_failures(Phase.AGREE, value, "c", CheckpointSaveError)


def test_failures_survive_pickling_in_transit() -> None:
    failed = pickle.loads(pickle.dumps(_Failed(1, Phase.WRITE, StorageError("write", "p", "x"))))
    assert failed.failure.rank == 1 and failed.failure.error_type == "StorageError"
    assert isinstance(failed.exception(), StorageError)


# ---------------------------------------------------------------- a failed collective's meaning


@pytest.mark.parametrize(
    ("error", "timeout_cls", "family"),
    [
        (CheckpointSaveError, SaveTimeoutError, CheckpointSaveError),
        (CheckpointLoadError, LoadTimeoutError, CheckpointLoadError),
        (DistributedFailure, CheckpointTimeoutError, DistributedFailure),
    ],
)
def test_ranks_that_never_arrived_are_named_in_the_operations_timeout(
    error, timeout_cls, family
) -> None:
    rank0, _rank1 = pair()  # rank 1 never calls the collective
    cause = RuntimeError("Timed out waiting 7000ms for recv operation to complete")
    with pytest.raises(timeout_cls) as info:
        rank0._collective(Phase.COMMIT, "ckpt-9", raiser(cause), error=error)
    exc = info.value
    assert type(exc) is timeout_cls
    assert isinstance(exc, CheckpointTimeoutError) and isinstance(exc, family)
    assert isinstance(exc, TimeoutError)
    assert exc.missing_ranks == [1]
    assert exc.timeout_s == 7.0 and exc.phase_name == "commit"
    assert exc.failed_ranks == [1]  # the absent rank is the cause, not this one
    assert exc.__cause__ is cause
    assert "ckpt-9" in str(exc) and "7.0s" in str(exc)


def test_load_and_save_timeouts_are_caught_as_load_and_save_errors() -> None:
    rank0, _ = pair()
    with pytest.raises(CheckpointLoadError):
        rank0._collective(Phase.LOAD, "c", raiser(TimeoutError()), error=CheckpointLoadError)
    rank0, _ = pair()
    with pytest.raises(CheckpointSaveError):
        rank0._collective(Phase.COMMIT, "c", raiser(TimeoutError()), error=CheckpointSaveError)


@pytest.mark.parametrize(
    "cause",
    [
        RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"),
        RuntimeError("Timed out waiting 3000ms for recv operation to complete"),
        TimeoutError("socket"),
        ConnectionResetError("reset"),
        RuntimeError("Broken pipe"),
    ],
    ids=["closed", "gloo-timeout", "TimeoutError", "ConnectionResetError", "broken-pipe"],
)
def test_a_lost_peer_blames_the_others_with_this_ranks_failure_attached(cause) -> None:
    rank0, rank1 = pair()
    rank1._collective(Phase.COMMIT, "c", lambda: None, error=CheckpointSaveError)  # arrives
    with pytest.raises(SaveTimeoutError) as info:
        rank0._collective(Phase.COMMIT, "ckpt", raiser(cause), error=CheckpointSaveError)
    exc = info.value
    assert exc.missing_ranks == [1]
    assert exc.failed_ranks == [0, 1]
    own = exc.failures[0]
    assert (own.phase, own.error_type, own.message) == ("commit", type(cause).__name__, str(cause))
    assert exc.failures[1].error_type == "Timeout"
    assert exc.__cause__ is cause


def test_a_lost_peer_names_every_other_rank_of_a_larger_group() -> None:
    coords = pair(world_size=4)
    for rank in (0, 2, 3):  # everyone else arrived, then the connection broke
        coords[rank]._collective(Phase.LOAD, "c", lambda: None, error=CheckpointLoadError)
    with pytest.raises(LoadTimeoutError) as info:
        coords[1]._collective(
            Phase.LOAD, "c", raiser(RuntimeError("connection reset")), error=CheckpointLoadError
        )
    assert info.value.missing_ranks == [0, 2, 3]
    assert info.value.failures[1].error_type == "RuntimeError"


@pytest.mark.parametrize(
    ("error", "expected"),
    [(CheckpointSaveError, CheckpointSaveError), (CheckpointLoadError, CheckpointLoadError)],
)
def test_any_other_exception_is_this_ranks_own_failure_not_a_timeout(error, expected) -> None:
    rank0, rank1 = pair()
    rank1._collective(Phase.SAVE_PLAN, "c", lambda: None, error=error)  # arrives
    cause = pickle.PicklingError("Can't pickle <function <lambda>>: attribute lookup failed")
    with pytest.raises(DistributedFailure) as info:
        rank0._collective(Phase.SAVE_PLAN, "ckpt", raiser(cause), error=error)
    exc = info.value
    assert type(exc) is expected
    assert not isinstance(exc, CheckpointTimeoutError)
    assert exc.failed_ranks == [0]
    assert exc.failures[0].error_type == "PicklingError"
    assert exc.__cause__ is cause


def test_untracked_collectives_classify_without_arrival_keys() -> None:
    rank0, _ = pair()  # rank 1 never arrives, but untracked collectives do not look
    with pytest.raises(CheckpointSaveError) as info:
        rank0._collective(
            Phase.AGREE, "c", raiser(TypeError("bad")), error=CheckpointSaveError, track=False
        )
    assert type(info.value) is CheckpointSaveError and info.value.failed_ranks == [0]
    with pytest.raises(SaveTimeoutError) as timed_out:
        rank0._collective(
            Phase.AGREE, "c", raiser(TimeoutError()), error=CheckpointSaveError, track=False
        )
    assert timed_out.value.missing_ranks == [1]
    assert rank0._seq == 0


def test_arrival_keys_are_set_per_collective_and_the_previous_one_removed() -> None:
    rank0, _ = pair()
    rank0._collective(Phase.AGREE, "c", lambda: None, error=CheckpointSaveError)
    assert arrived(rank0, 1, 0)
    rank0._collective(Phase.AGREE, "c", lambda: None, error=CheckpointSaveError)
    assert arrived(rank0, 2, 0) and not arrived(rank0, 1, 0)
    assert rank0._seq == 2


def test_lost_peer_words_are_recognized_case_insensitively() -> None:
    assert _lost_peer(RuntimeError("Connection Refused"))
    assert _lost_peer(OSError("TIMED OUT"))
    assert not _lost_peer(TypeError("cannot pickle 'generator' object"))
    assert not _lost_peer(ValueError("bad value"))


def test_an_immediate_own_failure_is_not_blamed_on_a_rank_that_is_still_on_its_way() -> None:
    rank0, _rank1 = pair()  # rank 1 is alive, just a little behind (not in the collective yet)
    cause = TypeError("cannot pickle 'generator' object")
    with pytest.raises(CheckpointSaveError) as info:
        rank0._collective(Phase.SAVE_PLAN, "ckpt", raiser(cause), error=CheckpointSaveError)
    # rank 0's own failure, at once: not a timeout blaming a healthy rank that is merely late
    assert not isinstance(info.value, CheckpointTimeoutError)
    assert info.value.failed_ranks == [0]
