"""Staging a rank's items: the reused HostArena and the payload layout (64-byte aligned
items, zero padding, the same file image staged or direct)."""

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_elastic.core.save.snapshot import LazyRule
from lightning_elastic.core.save.stage import (
    ALIGNMENT,
    HostArena,
    Payload,
    direct_payload,
    stage_lazily,
    stage_payload,
)


def planned(state: dict):
    """This (only) rank's final write items and the planner that resolves them."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    plans, _ = planner.create_global_plan([planner.create_local_plan()])
    return planner.finish_plan(plans[0]).items, planner


def image(payload: Payload) -> bytes:
    return b"".join(bytes(chunk) for chunk in payload.chunks())


def odd_state() -> dict:
    return {
        "a": torch.arange(5, dtype=torch.float32),  # 20 bytes: padding follows
        "b": torch.full((3,), 7, dtype=torch.int16),  # 6 bytes
        "c": torch.ones(2, 3, dtype=torch.bfloat16),  # 12 bytes
        "obj": {"k": "v"},  # serialized object bytes
        "empty": torch.zeros(0),
        "last": torch.tensor([1.5, -2.5], dtype=torch.float64),
    }


# ---------------------------------------------------------------- HostArena


def test_a_new_arena_holds_nothing() -> None:
    arena = HostArena()
    assert arena.capacity == 0 and arena.allocations == 0


def test_reserve_allocates_zeroed_aligned_memory_with_headroom() -> None:
    arena = HostArena(headroom=0.5)
    view = arena.reserve(1000)
    assert view.dtype == torch.uint8 and view.numel() == 1000
    assert arena.allocations == 1
    assert arena.capacity >= 1500 and arena.capacity % ALIGNMENT == 0
    assert int(view.count_nonzero()) == 0
    assert view.data_ptr() % 4096 == 0  # page aligned for O_DIRECT writes


def test_the_arena_is_reused_while_it_is_large_enough() -> None:
    arena = HostArena(headroom=0.1)
    first = arena.reserve(4000)
    capacity = arena.capacity
    first.fill_(3)
    again = arena.reserve(4000)
    smaller = arena.reserve(10)
    within_headroom = arena.reserve(capacity)
    assert arena.allocations == 1 and arena.capacity == capacity
    assert again.data_ptr() == smaller.data_ptr() == within_headroom.data_ptr() == first.data_ptr()
    assert smaller.numel() == 10 and int(again[0]) == 3  # same bytes, not re-zeroed


def test_the_arena_grows_only_when_asked_for_more_than_it_holds() -> None:
    arena = HostArena(headroom=0.0)
    arena.reserve(100)
    capacity = arena.capacity
    grown = arena.reserve(capacity + 1)
    assert arena.allocations == 2
    assert arena.capacity >= capacity + 1 and grown.numel() == capacity + 1
    assert int(grown.count_nonzero()) == 0  # a new buffer starts zeroed


def test_release_frees_the_buffer_and_the_next_reserve_allocates_again() -> None:
    arena = HostArena()
    arena.reserve(64)
    arena.release()
    assert arena.capacity == 0
    arena.reserve(64)
    assert arena.allocations == 2


def test_reserving_zero_bytes_gives_an_empty_view() -> None:
    arena = HostArena()
    assert arena.reserve(0).numel() == 0


# ---------------------------------------------------------------- layout


def test_items_are_placed_at_64_byte_aligned_offsets_in_plan_order() -> None:
    items, planner = planned(odd_state())
    payload = stage_payload(items, planner, HostArena())
    offsets = [item.offset for item in payload.items]
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    assert offsets == sorted(offsets)
    assert [i.write_item for i in payload.items] == list(items)
    ends = [i.offset + i.length for i in payload.items]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))
    assert payload.size == ends[-1]  # no trailing padding
    lengths = {i.write_item.index.fqn: i.length for i in payload.items}
    assert lengths["a"] == 20 and lengths["b"] == 6 and lengths["c"] == 12
    assert lengths["empty"] == 0 and lengths["last"] == 16
    assert payload.data_bytes == sum(lengths.values())


def test_staged_bytes_are_the_tensors_raw_bytes() -> None:
    state = odd_state()
    items, planner = planned(state)
    payload = stage_payload(items, planner, HostArena())
    data = image(payload)
    for item in payload.items:
        fqn = item.write_item.index.fqn
        if fqn in state and isinstance(state[fqn], torch.Tensor):
            expected = state[fqn].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert data[item.offset : item.offset + item.length] == expected, fqn
            assert bytes(item.data) == expected


def test_padding_between_items_is_zero() -> None:
    items, planner = planned(odd_state())
    payload = stage_payload(items, planner, HostArena())
    data = image(payload)
    position = 0
    for item in payload.items:
        assert data[position : item.offset] == bytes(item.offset - position)
        position = item.offset + item.length
    assert len(data) == payload.size


def test_staged_and_direct_payloads_write_the_same_file_image() -> None:
    items, planner = planned(odd_state())
    staged = stage_payload(items, planner, HostArena())
    direct = direct_payload(items, planner)
    assert direct.image is None and staged.image is not None
    assert direct.size == staged.size
    assert [(i.offset, i.length) for i in direct.items] == [
        (i.offset, i.length) for i in staged.items
    ]
    assert image(direct) == image(staged) == bytes(staged.image)


def test_a_staged_payload_no_longer_aliases_the_live_tensors() -> None:
    state = {"w": torch.ones(8)}
    items, planner = planned(state)
    payload = stage_payload(items, planner, HostArena())
    state["w"].fill_(-1)
    assert image(payload) == torch.ones(8).numpy().tobytes()


def test_a_lazy_stage_copies_the_unguarded_now_and_the_guarded_when_its_snapshot_runs() -> None:
    state = odd_state()
    items, planner = planned(state)
    expected = image(stage_payload(items, planner, HostArena()))
    arena = HostArena()
    payload, snapshot = stage_lazily(items, planner, arena, LazyRule([state["a"], state["c"]]))
    assert snapshot.nbytes == 20 + 12 and not snapshot.done
    staged = image(payload)
    assert staged != expected  # a and c are not copied yet
    state["b"].fill_(0)  # copied already: no longer aliased
    snapshot.run()
    assert snapshot.done and image(payload) == expected
    snapshot.check()  # nothing changed since the save point


def test_direct_payload_of_a_non_contiguous_tensor_writes_its_logical_order() -> None:
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    items, planner = planned({"t": base.t()})
    direct = direct_payload(items, planner)
    assert image(direct) == base.t().contiguous().numpy().tobytes()


def test_restaging_into_a_reused_arena_overwrites_the_previous_save() -> None:
    arena = HostArena()
    items, planner = planned({"x": torch.full((16,), 1.0), "y": torch.full((16,), 2.0)})
    stage_payload(items, planner, arena)
    items, planner = planned({"x": torch.full((16,), 3.0), "y": torch.full((16,), 4.0)})
    payload = stage_payload(items, planner, arena)
    assert arena.allocations == 1
    expected = torch.full((16,), 3.0).numpy().tobytes() + torch.full((16,), 4.0).numpy().tobytes()
    assert image(payload) == expected  # 64-byte items: no padding in between


def test_write_chunks_cover_the_image_exactly_once(monkeypatch) -> None:
    from lightning_elastic.core.save import stage

    monkeypatch.setattr(stage, "WRITE_CHUNK", 128)
    items, planner = planned({"big": torch.arange(100, dtype=torch.float32), "s": torch.ones(1)})
    staged = stage_payload(items, planner, HostArena())
    direct = direct_payload(items, planner)
    staged_chunks = [len(c) for c in staged.chunks()]
    assert max(staged_chunks) == 128 and sum(staged_chunks) == staged.size
    assert image(direct) == image(staged)


def test_padding_is_zero_after_a_save_with_a_different_layout_reused_the_arena() -> None:
    arena = HostArena()
    items, planner = planned({"a": torch.full((40,), 7.0), "b": torch.ones(4)})
    stage_payload(items, planner, arena)  # a at [0, 160), b at 192
    items, planner = planned({"a": torch.full((3,), 2.0), "b": torch.ones(4)})
    payload = stage_payload(items, planner, arena)  # a at [0, 12), padding [12, 64), b at 64
    assert arena.allocations == 1
    assert bytes(payload.image)[12:64] == bytes(52)  # observed: 7.0f from the first save
    assert image(payload) == image(direct_payload(items, planner))


# ---------------------------------------------------------------- the reused layout


def restage(items, planner: DefaultSavePlanner, state: dict, arena: HostArena) -> Payload:
    """Stage ``state`` with the same plan items, as a reused plan does (core/save/plan.py)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    planner.state_dict, _ = flatten_state_dict(state)
    return stage_payload(items, planner, arena)


def test_the_same_plan_reuses_the_layout_and_writes_the_new_values() -> None:
    arena = HostArena()
    first = odd_state()
    items, planner = planned(first)
    stage_payload(items, planner, arena)
    program = arena.program
    second = odd_state()
    second["a"] = torch.arange(5, dtype=torch.float32) * 10
    second["c"] = torch.full((3, 2), 3.0, dtype=torch.bfloat16).t()  # non-contiguous source
    second["obj"] = {"k": "w"}  # an object of the same length
    payload = restage(items, planner, second, arena)
    assert arena.program is program  # the layout was reused
    assert image(payload) == image(direct_payload(items, planner))  # padding zero as well
    assert bytes(payload.items[0].data) == second["a"].numpy().tobytes()


def test_a_new_length_or_a_new_buffer_lays_the_items_out_again() -> None:
    arena = HostArena(headroom=0.0)
    items, planner = planned({"x": torch.ones(3), "obj": "short"})
    stage_payload(items, planner, arena)
    program = arena.program
    payload = restage(items, planner, {"x": torch.ones(3), "obj": "longer" * 1000}, arena)
    assert arena.program is not program
    assert image(payload) == image(direct_payload(items, planner))
    arena.release()
    assert arena.program is None  # the old layout does not keep the old buffer alive
    payload = stage_payload(items, planner, arena)
    assert image(payload) == image(direct_payload(items, planner))


def test_a_state_that_no_longer_matches_the_plan_is_refused() -> None:
    import pytest

    arena = HostArena()
    items, planner = planned({"x": torch.ones(4)})
    stage_payload(items, planner, arena)
    with pytest.raises(ValueError, match=r"x: the state holds torch\.float64"):
        restage(items, planner, {"x": torch.ones(4, dtype=torch.float64)}, arena)


def run_state(scale: float) -> dict:
    """Back-to-back runs (1-D float32 of 64 bytes, 2-D rows of 16 float32), broken by another
    dtype, a 0-d tensor, an object, padding and a non-contiguous or conjugate source."""
    g = torch.Generator().manual_seed(5)
    state: dict = {f"v{i}": torch.randn(16, generator=g) * scale for i in range(6)}
    state.update({f"m{i}": torch.randn(i + 1, 16, generator=g) * scale for i in range(4)})
    state["half"] = torch.ones(32, dtype=torch.float16) * scale
    state["t"] = torch.randn(16, 3, generator=g).t().contiguous().t() * scale  # non-contiguous
    state["u"] = torch.randn(16, generator=g)
    state["scalar"] = torch.tensor(scale)
    state["obj"] = {"k": "v"}
    state["odd"] = torch.arange(5, dtype=torch.float32) * scale  # 20 bytes: padding follows
    state["w"] = torch.randn(16, generator=g) * scale
    state["z"] = torch.randn(4, dtype=torch.complex64, generator=g).conj()
    return state


def test_items_back_to_back_are_copied_in_runs_and_staged_exactly() -> None:
    arena = HostArena()
    items, planner = planned(run_state(1.0))
    payload = stage_payload(items, planner, arena)
    assert image(payload) == image(direct_payload(items, planner))
    program = arena.program
    assert program is not None and program.runs and program.singles
    covered = sorted(
        [k for start, stop, _ in program.runs for k in range(start, stop)] + program.singles
    )
    assert covered == list(range(len(program.tensors)))  # every tensor exactly once
    assert max(stop - start for start, stop, _ in program.runs) >= 6
    payload = restage(items, planner, run_state(-3.0), arena)
    assert arena.program is program
    assert image(payload) == image(direct_payload(items, planner))
