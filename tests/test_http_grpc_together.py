"""Every front end of one daemon at once (memcached text, meta and binary, HTTP, gRPC): every ID unique."""

from __future__ import annotations

import http.client
import itertools
import threading

import bmemcached
import grpc
from conftest import DaemonFactory, decode, free_port, recv_until, wait_for_port
from test_daemon import get as mc_get
from test_daemon import stats as mc_stats

from katsubushi_py.frontends import katsubushi_pb2 as pb
from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

ROUNDS = 300


def test_every_front_end_at_once_never_shares_an_id(daemons: DaemonFactory) -> None:
    http_port, grpc_port = free_port(), free_port()
    d = daemons.start("--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_for_port(http_port, d.proc)
    wait_for_port(grpc_port, d.proc)
    results: dict[str, list[int]] = {}
    commands: dict[str, int] = {}  # what each client adds to STATS cmd_get
    errors: list[BaseException] = []
    start = threading.Barrier(15)

    def text_client(name: str) -> None:
        with d.connect(timeout=30) as s:
            start.wait()
            results[name] = [i for r in range(ROUNDS) for i in mc_get(s, *([b"k"] * (1 + r % 3)))]
            commands[name] = ROUNDS

    def meta_client(name: str) -> None:
        """mg alone, and quiet mg pipelines ended by mn (a meta multi-get)."""
        got: list[int] = []
        with d.connect(timeout=30) as s:
            start.wait()
            for r in range(ROUNDS):
                n = 1 + r % 3
                s.sendall(b"".join(b"mg k%d v q\r\n" % i for i in range(n)) + b"mn\r\n")
                lines = recv_until(s, b"MN\r\n").split(b"\r\n")
                got += [int(v) for head, v in zip(lines[0::2], lines[1::2], strict=False) if head.startswith(b"VA ")]
                commands[name] = commands.get(name, 0) + n
        results[name] = got

    def binary_client(name: str) -> None:
        """python-binary-memcached: GET alone, and get_multi (GETKQ ... GETK)."""
        client = bmemcached.Client([f"127.0.0.1:{d.port}"], socket_timeout=30)
        got: list[int] = []
        start.wait()
        for r in range(ROUNDS):
            if r % 2:
                got.append(int(client.get("k")))
                commands[name] = commands.get(name, 0) + 1
            else:
                keys = [f"k{i}" for i in range(1 + r % 3)]
                values = client.get_multi(keys)
                got += [int(values[k]) for k in keys]
                commands[name] = commands.get(name, 0) + len(keys)
        client.disconnect_all()
        results[name] = got

    def http_client(name: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        got: list[int] = []
        start.wait()
        for r in range(ROUNDS):
            conn.request("GET", "/id" if r % 2 else f"/ids?n={1 + r % 7}")
            response = conn.getresponse()
            body = response.read()
            assert response.status == 200, body
            got += [int(x) for x in body.split(b"\n")]
        conn.close()
        results[name] = got
        commands[name] = ROUNDS

    def grpc_client(name: str) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            generator = pb_grpc.GeneratorStub(channel)
            got: list[int] = []
            start.wait()
            for r in range(ROUNDS):
                if r % 2:
                    got.append(generator.Fetch(pb.FetchRequest(), timeout=30).id)
                else:
                    got += generator.FetchMulti(pb.FetchMultiRequest(n=1 + r % 5), timeout=30).ids
            results[name] = got
            commands[name] = ROUNDS

    def run(target, name: str) -> None:  # type: ignore[no-untyped-def]
        try:
            target(name)
        except BaseException as exc:  # reported below, with the others' results
            errors.append(exc)
            start.abort()

    threads = [
        threading.Thread(target=run, args=(client, f"{client.__name__}-{i}"))
        for client in (text_client, meta_client, binary_client, http_client, grpc_client)
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 15
    every = [i for ids in results.values() for i in ids]
    assert len(set(every)) == len(every), "an ID was issued twice"
    for name, ids in results.items():
        assert all(a < b for a, b in itertools.pairwise(ids)), name  # increasing on each connection
        assert {decode(i)[1] for i in ids} == {7}
    with d.connect() as mc:
        fields = mc_stats(mc)
    d.wait_for_log("(loop uvloop)")  # gRPC (grpc.aio) shares the daemon's uvloop loop
    assert int(fields["get_hits"]) == len(every)
    assert int(fields["cmd_get"]) == sum(commands.values()) and fields["get_misses"] == "0"


def test_http_and_grpc_on_the_standard_asyncio_loop_too(daemons: DaemonFactory) -> None:
    http_port, grpc_port = free_port(), free_port()
    d = daemons.start("--loop", "asyncio", "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_for_port(http_port, d.proc)
    wait_for_port(grpc_port, d.proc)
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
    conn.request("GET", "/ids?n=2")
    first = [int(x) for x in conn.getresponse().read().split(b"\n")]
    conn.close()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        then = pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=10).id
    assert first[0] < first[1] < then
    d.wait_for_log("(loop asyncio)")
    assert d.stop() == 0
