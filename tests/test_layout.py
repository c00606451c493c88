from datetime import UTC, datetime, timedelta

import pytest
from conftest import FAKE_START_MS
from hypothesis import example, given
from hypothesis import strategies as st

from katsubushi_py.ids.layout import DEFAULT_LAYOUT, KATSUBUSHI_EPOCH_MS, Layout, LayoutError, format_time


def test_known_vectors() -> None:
    assert DEFAULT_LAYOUT.id_at(1465276650) == 189608755200000000
    assert DEFAULT_LAYOUT.id_at(1465276650.777) == 189608758458974208
    assert DEFAULT_LAYOUT.id_at(datetime(2016, 6, 7, 5, 17, 30, 777000, tzinfo=UTC)) == 189608758458974208
    parts = DEFAULT_LAYOUT.decompose(189608758458974208)
    assert format_time(parts.time) == "2016-06-07T05:17:30.777Z"
    assert (parts.worker_id, parts.sequence) == (0, 0)
    assert parts.unix_ms == 1465276650777


def test_katsubushi_observed_id() -> None:
    # Seen on a running go-katsubushi v2.0.4 (reference section 3).
    parts = DEFAULT_LAYOUT.decompose(1574003989400260608)
    assert format_time(parts.time) == "2026-11-22T10:09:54.653Z"
    assert (parts.worker_id, parts.sequence) == (1, 0)


def test_default_is_katsubushi_bit_layout() -> None:
    layout = DEFAULT_LAYOUT
    assert layout.epoch_ms == KATSUBUSHI_EPOCH_MS == 1420070400000
    assert (layout.time_shift, layout.worker_shift) == (22, 12)
    assert layout.compose(KATSUBUSHI_EPOCH_MS + 5, 3, 9) == (5 << 22) | (3 << 12) | 9
    assert format_time(layout.lifetime_end) == "2084-09-06T15:47:35.552Z"


ms_in_range = st.integers(min_value=KATSUBUSHI_EPOCH_MS, max_value=KATSUBUSHI_EPOCH_MS + (1 << 41) - 1)


@given(ms_in_range, st.integers(0, 1023), st.integers(0, 4095))
@example(KATSUBUSHI_EPOCH_MS, 0, 0)
@example(KATSUBUSHI_EPOCH_MS + (1 << 41) - 1, 1023, 4095)
def test_compose_decompose_round_trip(unix_ms: int, worker: int, seq: int) -> None:
    id_ = DEFAULT_LAYOUT.compose(unix_ms, worker, seq)
    assert 0 <= id_ < 1 << 63
    parts = DEFAULT_LAYOUT.decompose(id_)
    assert (parts.unix_ms, parts.worker_id, parts.sequence) == (unix_ms, worker, seq)
    assert DEFAULT_LAYOUT.id_at(parts.time) <= id_
    if unix_ms < DEFAULT_LAYOUT.lifetime_end_ms - 1:
        assert id_ < DEFAULT_LAYOUT.id_at(parts.time + timedelta(milliseconds=1))
    else:
        with pytest.raises(LayoutError, match="past the layout's lifetime"):
            DEFAULT_LAYOUT.id_at(parts.time + timedelta(milliseconds=1))


@given(st.integers(0, (1 << 63) - 1))
def test_every_63_bit_value_decomposes_and_recomposes(id_: int) -> None:
    parts = DEFAULT_LAYOUT.decompose(id_)
    assert DEFAULT_LAYOUT.compose(parts.unix_ms, parts.worker_id, parts.sequence) == id_


@given(
    st.integers(30, 45),
    st.integers(0, 10),
    st.integers(1, 16),
    st.integers(0, 10**6),
)
def test_round_trip_in_custom_layouts(time_bits: int, worker_bits: int, seq_bits: int, offset_ms: int) -> None:
    if time_bits + worker_bits + seq_bits > 63:
        return
    epoch = FAKE_START_MS - 10**9
    try:
        layout = Layout(epoch, time_bits, worker_bits, seq_bits, now_ms=FAKE_START_MS)
    except LayoutError:
        assert epoch + (1 << time_bits) - FAKE_START_MS < 365 * 86400 * 1000
        return
    worker, seq = layout.max_worker_id, layout.max_sequence
    id_ = layout.compose(epoch + offset_ms, worker, seq)
    parts = layout.decompose(id_)
    assert (parts.unix_ms, parts.worker_id, parts.sequence) == (epoch + offset_ms, worker, seq)


def test_41_6_16_layout() -> None:
    layout = Layout(time_bits=41, worker_bits=6, sequence_bits=16)
    assert layout.max_worker_id == 63 and layout.max_sequence == 65535
    assert layout.ids_per_second_ceiling == 65_536_000
    id_ = layout.compose(FAKE_START_MS, 63, 65535)
    assert layout.decompose(id_).worker_id == 63


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"time_bits": 42, "worker_bits": 10, "sequence_bits": 12}, "64 bits"),
        ({"epoch_ms": FAKE_START_MS + 1000}, "in the future"),
        ({"epoch_ms": FAKE_START_MS - 1000, "time_bits": 34}, "less than a year"),
        ({"time_bits": 0}, "at least 1"),
        ({"sequence_bits": 0}, "at least 1"),
        ({"worker_bits": -1}, "non-negative"),
    ],
)
def test_layout_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Layout(**kwargs, now_ms=FAKE_START_MS)


def test_layout_with_just_over_a_year_is_accepted() -> None:
    # 2^35 ms is about 1.09 years.
    layout = Layout(epoch_ms=FAKE_START_MS, time_bits=35, now_ms=FAKE_START_MS)
    assert layout.lifetime_end_ms == FAKE_START_MS + (1 << 35)


def test_worker_id_must_fit() -> None:
    assert DEFAULT_LAYOUT.check_worker_id(1023) == 1023
    with pytest.raises(LayoutError, match="does not fit in 10 bits"):
        DEFAULT_LAYOUT.check_worker_id(1024)
    with pytest.raises(LayoutError):
        DEFAULT_LAYOUT.check_worker_id(-1)


def test_instants_outside_the_layout_are_rejected() -> None:
    with pytest.raises(LayoutError, match="before the layout's epoch"):
        DEFAULT_LAYOUT.id_at(datetime(2014, 12, 31, 23, 59, 59, tzinfo=UTC))
    with pytest.raises(LayoutError, match="past the layout's lifetime"):
        DEFAULT_LAYOUT.id_at(datetime(2085, 1, 1, tzinfo=UTC))
    with pytest.raises(LayoutError, match="not an ID"):
        DEFAULT_LAYOUT.decompose(1 << 63)
    with pytest.raises(LayoutError, match="not an ID"):
        DEFAULT_LAYOUT.decompose(-1)


def test_id_at_naive_datetime_is_utc() -> None:
    assert DEFAULT_LAYOUT.id_at(datetime(2016, 6, 7, 5, 17, 30)) == 189608755200000000
    jst = datetime.fromisoformat("2016-06-07T14:17:30+09:00")
    assert DEFAULT_LAYOUT.id_at(jst) == 189608755200000000
