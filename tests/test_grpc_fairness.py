"""Fairness on gRPC (issue 33): one read that carries many calls cannot stall other connections.

``FetchMulti`` asks for at most 1,000 IDs a call, but one read can carry as many calls as the client's
flow-control window takes, and before the slicing they were all answered in one go. Now a read is
answered a piece at a time (``grpc_frames.PIECE_BUDGET``), and the connection glue lets every other
connection in between two slices. The daemon is a real process on real sockets; the IDs say in which
order requests were served, as in tests/test_hostile_small.py's fairness tests for memcached and HTTP.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from conftest import Daemon, DaemonFactory, free_port, parse_values, recv_until, wait_for_port
from grpc_conversations import FETCH_MULTI, Client, grpc_headers, make_server, message, varint

from katsubushi_py.frontends.grpc_frames import CALL_COST, FRAME_COST, PIECE_BUDGET

CALLS = 80  # FetchMulti calls of 1,000 IDs in B's one write: twenty ms of the generator at 4,096 IDs a ms

# The fast path (compiled or pure) serves plain calls; a grpc-encoding other than identity makes a
# call the slow path's (h2 decodes and answers every one of them).
PATHS = pytest.mark.parametrize(
    "pure,slow",
    [(False, False), (True, False), (False, True)],
    ids=["compiled-fast", "pure-fast", "h2-slow"],
)


def _burst(client: Client, slow: bool) -> list[int]:
    """CALLS FetchMulti n=1000 on ``client``, its window opened for all their replies; their stream ids."""
    client.h2.increment_flow_control_window(1 << 26)
    extra = {"grpc_encoding": b"gzip"} if slow else {}
    sids = []
    for _ in range(CALLS):
        sid = client.open(FETCH_MULTI, grpc_headers(FETCH_MULTI, **extra))
        client.h2.send_data(sid, message(b"\x08" + varint(1000)), end_stream=True)
        sids.append(sid)
    return sids


def _read_replies(sock: socket.socket, client: Client, sids: list[int]) -> None:
    deadline = time.monotonic() + 20
    while not all(client.replies[sid].ended for sid in sids):
        assert time.monotonic() < deadline, "B's replies did not all arrive"
        data = sock.recv(1 << 20)
        assert data, "the daemon closed B's connection"
        client.take(data)
        sock.sendall(client.pending())


def _race(d: Daemon, grpc_port: int, slow: bool) -> tuple[list[int], list[int]]:
    """A's IDs, asked one at a time over memcached while B's one write of CALLS calls is answered; B's IDs."""
    big = socket.socket()
    big.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # B's replies fit: writing never pauses
    big.settimeout(10)
    big.connect(("127.0.0.1", grpc_port))
    client = Client()
    big.sendall(client.pending())
    client.take(big.recv(1 << 16))  # the server's SETTINGS
    big.sendall(client.pending())  # their acknowledgement
    small = d.connect()
    small.sendall(b"get a\r\n")
    recv_until(small, b"END\r\n")  # connected and served before B starts
    served: list[int] = []
    done = threading.Event()

    def one_at_a_time() -> None:
        while not done.is_set():
            small.sendall(b"get a\r\n")
            served.extend(value for _, value in parse_values(recv_until(small, b"END\r\n")))

    asker = threading.Thread(target=one_at_a_time)
    sids = _burst(client, slow)
    burst = client.pending()
    asker.start()
    big.sendall(burst)
    time.sleep(0.3)  # B reads nothing meanwhile: its replies wait in the socket buffers
    done.set()
    asker.join()
    _read_replies(big, client, sids)
    theirs: list[int] = []
    for sid in sids:
        reply = client.replies[sid]
        assert reply.trailers.get(b"grpc-status") == b"0", (sid, reply.summary())
        ids = reply.ids()
        assert len(ids) == 1000 and ids == sorted(ids), sid  # each call's IDs, in order
        theirs += ids
    assert theirs == sorted(theirs)  # the calls answered in the order they were made
    big.close()
    small.close()
    return served, theirs


@pytest.mark.once
@PATHS
def test_a_concurrent_client_is_served_between_the_slices_of_a_burst_of_grpc_calls(
    daemons: DaemonFactory, pure: bool, slow: bool
) -> None:
    """A asks memcached for one ID at a time, back to back, while B's one write carries 40 FetchMulti
    calls of 1,000 IDs. Some of A's IDs fall strictly inside B's range: A was answered between two
    slices of B's read. Before the slicing the whole read was answered in one go, and every one of
    A's IDs was below or above all of B's. B's 40,000 IDs are all there, unique, each call's in
    order and the calls answered in order."""
    grpc_port = free_port()
    d = daemons.start("--grpc-port", str(grpc_port), env={"KATSUBUSHI_NO_EXTENSIONS": "1" if pure else "0"})
    wait_for_port(grpc_port, d.proc)
    inside: list[int] = []
    for _ in range(5):  # A's first request may race ahead of B's: then try again
        served, theirs = _race(d, grpc_port, slow)
        assert len(theirs) == CALLS * 1000 and len(set(theirs) | set(served)) == len(theirs) + len(served)
        low, high = min(theirs), max(theirs)
        inside = [i for i in served if low < i < high]
        if inside:
            break
    assert len(inside) >= 2, f"none of A's {len(served)} requests was served between the slices of B's calls"


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "h2-slow"])
def test_one_read_of_many_calls_is_answered_a_piece_at_a_time(slow: bool) -> None:
    """Sans-IO: one read of CALLS calls is answered a bounded piece per receive or resume, the rest
    held (``backlog``); what arrives meanwhile is held behind it, not answered ahead of it; and the
    pieces together answer every call, in order, with unique IDs."""
    server, _ = make_server(drained=False)
    client = Client()
    client.take(server.receive(client.pending()))
    client.take(server.receive(client.pending()))
    sids = _burst(client, slow)
    one_call = 9 + 20 + 9 + 5 + 3 + 10 * 1000 + 9 + 15  # a reply's frames at most
    most = PIECE_BUDGET + one_call + (FRAME_COST if slow else CALL_COST)
    pieces = [server.receive(client.pending())]
    assert server.backlog and len(pieces[0]) <= most
    late = client.call(FETCH_MULTI, b"\x08\x02")  # arrives while the read is held: answered after it
    assert server.receive(client.pending()) == b""
    while server.backlog:
        pieces.append(server.resume())
        assert len(pieces[-1]) <= most
    assert len(pieces) >= CALLS // 2  # a call of 1,000 IDs is more than 8 KB of reply: at most two a piece
    for piece in pieces:
        client.take(piece)
    ids = [i for sid in sids for i in client.replies[sid].ids()]
    assert len(ids) == CALLS * 1000 == len(set(ids)) and ids == sorted(ids)
    assert client.replies[late].ids()[0] > ids[-1]
