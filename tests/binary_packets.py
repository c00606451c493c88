"""memcached binary packets for tests, built and parsed independently of the package."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

HEADER = struct.Struct(">BBHBBHIIQ")  # magic, opcode, key len, extras len, data type, vbucket/status, body, opaque, cas

GET, SET, ADD, REPLACE, DELETE, INCREMENT, DECREMENT, QUIT = range(8)
FLUSH, GETQ, NOOP, VERSION, GETK, GETKQ, APPEND, PREPEND, STAT = range(8, 17)
SETQ, QUITQ, VERBOSITY, TOUCH, GAT = 0x11, 0x17, 0x1B, 0x1C, 0x1D

SUCCESS, INVALID_ARGUMENTS = 0x0000, 0x0004
UNKNOWN_COMMAND, NOT_SUPPORTED, INTERNAL_ERROR, TEMPORARY_FAILURE = 0x0081, 0x0083, 0x0084, 0x0086


class Packet(NamedTuple):
    opcode: int
    status: int
    opaque: int
    cas: int
    extras: bytes
    key: bytes
    value: bytes


def request(opcode: int, key: bytes = b"", opaque: int = 0, extras: bytes = b"", value: bytes = b"") -> bytes:
    body = len(extras) + len(key) + len(value)
    return HEADER.pack(0x80, opcode, len(key), len(extras), 0, 0, body, opaque, 0) + extras + key + value


def parse(data: bytes) -> tuple[list[Packet], bytes]:
    """Complete response packets in ``data`` and the bytes left over; checks the framing strictly."""
    packets = []
    pos = 0
    while len(data) - pos >= HEADER.size:
        magic, opcode, keylen, extlen, datatype, status, bodylen, opaque, cas = HEADER.unpack_from(data, pos)
        assert magic == 0x81 and datatype == 0, data[pos : pos + 24]
        assert keylen + extlen <= bodylen, data[pos : pos + 24]
        end = pos + HEADER.size + bodylen
        if end > len(data):
            break
        body = data[pos + HEADER.size : end]
        packets.append(
            Packet(opcode, status, opaque, cas, body[:extlen], body[extlen : extlen + keylen], body[extlen + keylen :])
        )
        pos = end
    return packets, data[pos:]


def parse_all(data: bytes) -> list[Packet]:
    packets, rest = parse(data)
    assert rest == b"", rest
    return packets


def read_packets(sock: socket.socket, count: int) -> list[Packet]:
    """Exactly ``count`` packets from ``sock`` (fails on a close or a timeout before that)."""
    data = b""
    while True:
        packets, _ = parse(data)
        if len(packets) >= count:
            assert len(packets) == count and parse(data)[1] == b"", data
            return packets
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed after {len(packets)} of {count} packets")
        data += chunk


def read_until_terminator(sock: socket.socket, opcode: int) -> list[Packet]:
    """Packets up to and including the first one of ``opcode`` (a NOOP, or STAT's empty terminator)."""
    data = b""
    while True:
        packets, rest = parse(data)
        for i, packet in enumerate(packets):
            if packet.opcode == opcode and (opcode != STAT or not packet.key):
                assert i == len(packets) - 1 and rest == b"", data
                return packets
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("connection closed before the terminator")
        data += chunk


def id_of(packet: Packet) -> int:
    """The ID a successful get carries: four zero flag bytes, then the decimal ID."""
    assert packet.status == SUCCESS and packet.extras == b"\x00\x00\x00\x00", packet
    assert packet.value.isdigit() and not packet.value.startswith(b"0"), packet
    return int(packet.value)
