"""The fuzz targets of issue 23 (fuzz/targets.py) in the normal suite: every seed of fuzz/corpus/ and
every input a fuzzer found (fuzz/findings/, each fixed) replayed through its target, on whichever hot
path this run uses (the targets compare the compiled core with its pure twin where it is built, and
always a request whole with the same request split). Each finding also has a test of its own below
that says what was wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from binary_packets import HEADER, NOOP, UNKNOWN_COMMAND, parse_all, request
from twins import Twins, check_splits

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
sys.path.insert(0, str(FUZZ))

import targets  # noqa: E402

CASES = [
    pytest.param(target.name, path, id=f"{path.parent.parent.name}/{target.name}/{path.name}")
    for kind in ("corpus", "findings")
    for target in sorted((FUZZ / kind).iterdir())
    if target.is_dir()
    for path in sorted(target.iterdir())
    if target.name in targets.TARGETS
]


@pytest.mark.parametrize(("target", "path"), CASES)
def test_fuzz_input_replays_cleanly(target: str, path: Path) -> None:
    targets.TARGETS[target](path.read_bytes())


def test_every_target_has_seeds() -> None:
    for name in targets.TARGETS:
        assert any((FUZZ / "corpus" / name).iterdir()), name


def test_a_target_fails_on_a_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks themselves can fail: replies that differ are told apart, and a decoder that took
    Arabic-Indic digits for an ID would be caught by the ids target."""
    compiled, pure = Twins("text").run([b"get a\r\n"])
    pure.reply += b"x"
    assert compiled.without_ids() != pure.without_ids()
    text = b"\x00" + "\u0661\u0662\u0663".encode()
    targets.ids(text)  # the real decoder refuses it cleanly
    monkeypatch.setitem(targets.encodings.ENCODINGS, "dec", (targets.encodings.encode_decimal, int))
    with pytest.raises(AssertionError, match="non-ASCII"):
        targets.ids(text)


def test_regression_binary_body_ending_with_a_read_leaves_the_parser_at_a_request() -> None:
    """Found by fuzzing (binary target): a request over 4 KiB answered from its header, whose body then
    ended exactly with a read, left the parser in its skip state (with nothing left to skip) when split
    after the header, and at a request's start when whole; the compiled fast path then stayed off for
    the next read. Both twins."""
    data = HEADER.pack(0x80, 0xF5, 240, 0, 0, 0, 4328, 0, 0) + b"k" * 4328
    whole = check_splits("binary", data, every=False, seed=7)
    [packet] = parse_all(whole.reply)
    assert packet.status == UNKNOWN_COMMAND and whole.state == 0
    whole = check_splits("binary", data + request(NOOP, opaque=3), every=False, seed=8)
    assert [p.opcode for p in parse_all(whole.reply)] == [0xF5, NOOP]


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
@pytest.mark.parametrize("length", [16_385, 0x4F4F4F, 0xFFFFFF])
def test_regression_grpc_oversize_frame_header_is_refused_at_once(pure: bool, length: int) -> None:
    """Found by fuzzing (gRPC target, a timeout): the 9-byte header of a frame over 16 KiB, alone,
    after the preface. h2 judges a frame's length only once the whole frame is in, so it buffered the
    header; the slow path kept it for the fast path too, which, steady, handed it back, over and over,
    h2's buffer growing 9 bytes a turn until the "frame" was complete: 577,518 turns and 20 s of CPU
    with the event loop held for a 5 MB length. Now GOAWAY FRAME_SIZE_ERROR from the header, at once,
    in both twins."""
    make, _ = targets._grpc_pair()
    conn, _clock = make(pure)
    calls = []
    slow = type(conn)._receive_slow

    def counting(self: object, data: bytes) -> bytes:
        calls.append(len(data))
        assert len(calls) < 10, "the slow path is called in a loop"
        return slow(self, data)

    cls = type(conn)  # (the connection has slots: its class is patched for the call)
    cls._receive_slow = counting
    try:
        reply = conn.receive(targets.PREFACE + length.to_bytes(3, "big") + b"\x4f\x4f\x4f\x4f\x4f\x5d")
    finally:
        cls._receive_slow = slow
    goaway = reply[-17:]
    assert goaway[3] == 7 and int.from_bytes(goaway[-4:], "big") == 6, reply.hex()  # GOAWAY, FRAME_SIZE_ERROR
    assert conn.closing and len(calls) <= 2
