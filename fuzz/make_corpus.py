"""Writes the seed corpora of fuzz/corpus/<target>/ (valid requests of every kind, so that the fuzzers
start from what clients send). Run it again after changing it; the files are kept in the repository.

Each seed starts with the bytes fuzz/targets.py reads first (options, chunking seed), then the payload.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from binary_packets import GET, GETK, GETKQ, GETQ, NOOP, QUIT, SET, STAT, VERSION, request  # noqa: E402

TEXT = [
    b"get a\r\n",
    b"get a b c\r\nGET d\r\ngets e f\r\n",
    b"get " + b" ".join(b"k%d" % i for i in range(130)) + b"\r\n",
    b"get a " + b"k" * 251 + b" z\r\n",
    b"set k 0 0 3\r\nabc\r\nadd k 1 2 3 noreply\r\nxyz\r\ncas k 0 0 1 7\r\nz\r\nappend k 0 0 -1\r\n",
    b"incr a 1\r\ndecr a 1\r\ndelete a\r\ntouch a 1\r\nflush_all\r\n",
    b"stats\r\nstats settings\r\nstats items\r\nstats slabs\r\nstats nosuch\r\nversion\r\nverbosity 1\r\n",
    b"mg a v\r\nmg b v k O123 q\r\nmg c t f s\r\nmn\r\n",
    b"ms k 5 T0\r\nhello\r\nms k 100000 T0\r\n",
    b"md a\r\nma a\r\nme a\r\nmn\r\n",
    b"quit\r\nget after\r\n",
    b"get\r\n\r\n   \r\nGeT a\r\n",
    b"gets a\r\n",
]

BINARY = [
    request(GET, opaque=1),
    request(GETK, b"a", opaque=2) + request(GETKQ, b"b", opaque=3) + request(GETQ, opaque=4) + request(NOOP, opaque=5),
    request(VERSION, opaque=1) + request(STAT, opaque=2) + request(STAT, b"settings", opaque=3),
    request(SET, b"k", opaque=3, extras=b"\0" * 8, value=b"v" * 100) + request(GET),
    request(GETKQ, b"k" * 250, opaque=5) + request(NOOP) + request(QUIT, opaque=7),
    request(0x42, b"x", opaque=4, value=b"y"),
    request(GET, b"k", value=b"v" * 4097),
]

HTTP = [
    b"GET /id HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /ids?n=3 HTTP/1.1\r\nHost: x\r\n\r\nGET /ids?n=0 HTTP/1.1\r\n\r\n",
    b"GET /stats HTTP/1.0\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"GET /decode/1234567890123456789 HTTP/1.1\r\n\r\nGET /decode/abc?encoding=hex HTTP/1.1\r\n\r\n",
    b"POST /id HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
    b"HEAD /nothing HTTP/1.1\r\n\r\n",
    b"GET http://host/id?x=1 HTTP/1.1\r\n\r\n",
    b"POST /ids HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"GET /id HTTP/1.1\r\nAccept: application/json\r\n\r\n" * 3,
]

IDS = [
    bytes((i,)) + text
    for i, text in enumerate(
        [b"1234567890123456789", b"0x112210f47de98115", b"0ZZZ-ABCD-1234", b"3Rp2XbQk1tP", b"1ZiCDLCs9u3"]
    )
]


def grpc_seeds() -> list[bytes]:
    from grpc_conversations import FETCH, FETCH_MULTI, STATS, Client, grpc_headers, message

    out = []
    client = Client()
    client.call(FETCH)
    client.call(FETCH_MULTI, b"\x08\x03")
    out.append(client.pending())
    client.call(FETCH)
    client.h2.ping(b"12345678")
    client.call(STATS)
    out.append(client.pending())
    client = Client()
    client.call(FETCH, headers=grpc_headers(FETCH, content_type=b"text/plain"))
    sid = client.open(FETCH_MULTI)
    client.h2.increment_flow_control_window(4096, sid)
    client.send(sid, message(b"\x08\x05"))
    out.append(client.pending())
    return out


def write(target: str, seeds: list[bytes]) -> None:
    directory = HERE / "corpus" / target
    directory.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        (directory / hashlib.sha1(seed).hexdigest()[:16]).write_bytes(seed)


def main() -> None:
    write("text", [b"\x00\x00\x01" + t for t in TEXT] + [b"\x01\x00\x07" + TEXT[1], b"\x80\x00\x03" + TEXT[0]])
    write("binary", [b"\x00\x00\x02" + b for b in BINARY] + [b"\x01\x00\x05" + bytes(range(40))])
    write("http", [b"\x00\x03" + h for h in HTTP])
    write("ids", IDS)
    write("grpc", [b"\x01\x00\x09" + g for g in grpc_seeds()] + [b"\x00\x00\x02\x04\x00\x00\x00\x06" + bytes(6)])
    write("transport", [b"\x00\x00\x01" + t for t in TEXT[:4]] + [b"\x02\x00\x01" + b for b in BINARY[:3]])


if __name__ == "__main__":
    main()
