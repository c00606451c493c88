"""go-katsubushi's gRPC service against the real daemon process, with grpcio clients."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from conftest import Daemon, DaemonFactory, daemon_env, decode, free_port, wait_for_port
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_daemon import stats as mc_stats

from katsubushi_py.frontends import katsubushi_pb2 as pb
from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc


def start_grpc(daemons: DaemonFactory, *args: str, **kwargs: object) -> tuple[Daemon, int]:
    port = free_port()
    d = daemons.start("--grpc-port", str(port), *args, **kwargs)  # type: ignore[arg-type]
    wait_for_port(port, d.proc)
    return d, port


@pytest.fixture
def served(daemons: DaemonFactory) -> Iterator[tuple[Daemon, grpc.Channel]]:
    d, port = start_grpc(daemons)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield d, channel
    channel.close()


def test_fetch_and_fetch_multi(served: tuple[Daemon, grpc.Channel]) -> None:
    _, channel = served
    generator = pb_grpc.GeneratorStub(channel)
    one = generator.Fetch(pb.FetchRequest(), timeout=5).id
    assert decode(one)[1] == 7
    three = list(generator.FetchMulti(pb.FetchMultiRequest(n=3), timeout=5).ids)
    assert len(three) == 3 and three == sorted(three) and three[0] > one
    default = list(generator.FetchMulti(pb.FetchMultiRequest(), timeout=5).ids)  # n = 0 means 1
    assert len(default) == 1 and default[0] > three[-1]
    thousand = list(generator.FetchMulti(pb.FetchMultiRequest(n=1000), timeout=5).ids)
    assert len(set(thousand)) == 1000 and thousand[0] > default[0]
    with pytest.raises(grpc.RpcError) as refused:
        generator.FetchMulti(pb.FetchMultiRequest(n=1001), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "too many IDs requested: 1001, n must be from 1 to 1000"  # HTTP's text


def test_stats_get_matches_memcached_stats(served: tuple[Daemon, grpc.Channel]) -> None:
    d, channel = served
    generator = pb_grpc.GeneratorStub(channel)
    generator.FetchMulti(pb.FetchMultiRequest(n=5), timeout=5)
    with pytest.raises(grpc.RpcError):
        generator.FetchMulti(pb.FetchMultiRequest(n=2000), timeout=5)
    reply = pb_grpc.StatsStub(channel).Get(pb.StatsRequest(), timeout=5)
    with d.connect() as mc:
        fields = mc_stats(mc)
    assert reply.pid == int(fields["pid"]) == d.pid
    assert reply.version == fields["version"]
    assert (reply.cmd_get, reply.get_hits, reply.get_misses) == (2, 5, 0)
    assert (reply.cmd_get, reply.get_hits, reply.get_misses) == tuple(
        int(fields[k]) for k in ("cmd_get", "get_hits", "get_misses")
    )
    assert reply.uptime <= int(fields["uptime"]) and reply.time <= int(fields["time"])  # asked a moment earlier


def test_reflection_lists_the_services_and_describes_the_messages(served: tuple[Daemon, grpc.Channel]) -> None:
    _, channel = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="katsubushi.Generator"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"katsubushi.Generator", "katsubushi.Stats"} <= names
    proto = descriptor_pb2.FileDescriptorProto.FromString(described.file_descriptor_response.file_descriptor_proto[0])
    assert proto.package == "katsubushi"
    services = {s.name: {m.name: (m.input_type, m.output_type) for m in s.method} for s in proto.service}
    assert services == {
        "Generator": {
            "Fetch": (".katsubushi.FetchRequest", ".katsubushi.FetchResponse"),
            "FetchMulti": (".katsubushi.FetchMultiRequest", ".katsubushi.FetchMultiResponse"),
        },
        "Stats": {"Get": (".katsubushi.StatsRequest", ".katsubushi.StatsResponse")},
    }
    fields = {m.name: [(f.name, f.number, f.type, f.label) for f in m.field] for m in proto.message_type}
    t = descriptor_pb2.FieldDescriptorProto
    assert fields["FetchMultiRequest"] == [("n", 1, t.TYPE_UINT32, t.LABEL_OPTIONAL)]
    assert fields["FetchResponse"] == [("id", 1, t.TYPE_UINT64, t.LABEL_OPTIONAL)]
    assert fields["FetchMultiResponse"] == [("ids", 1, t.TYPE_UINT64, t.LABEL_REPEATED)]
    assert [(name, number) for name, number, _, _ in fields["StatsResponse"]] == [
        ("pid", 1),
        ("uptime", 2),
        ("time", 3),
        ("version", 4),
        ("curr_connections", 5),
        ("total_connections", 6),
        ("cmd_get", 7),
        ("get_hits", 8),
        ("get_misses", 9),
    ]


def test_raw_bytes_as_go_katsubushis_clients_send_them(served: tuple[Daemon, grpc.Channel]) -> None:
    """Generic calls with hand-written protobuf bytes, as in the go-katsubushi transcript."""
    _, channel = served
    fetch_multi = channel.unary_unary("/katsubushi.Generator/FetchMulti")
    raw = fetch_multi(b"\x08\x03", timeout=5)  # n = 3
    assert raw[0] == 0x0A  # field 1, length-delimited: packed repeated uint64
    assert len(pb.FetchMultiResponse.FromString(raw).ids) == 3
    with pytest.raises(grpc.RpcError) as unknown:
        channel.unary_unary("/katsubushi.Generator/Nope")(b"", timeout=5)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sigterm_with_a_grpc_channel_open_exits_zero(served: tuple[Daemon, grpc.Channel]) -> None:
    d, channel = served
    assert pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=5).id
    assert d.stop() == 0
    assert "stopped" in d.stderr()


def test_grpc_listens_on_host_only(daemons: DaemonFactory) -> None:
    # 127.0.0.2 reaches this machine too, but not a socket bound to 127.0.0.1 (go-katsubushi binds all).
    _, port = start_grpc(daemons)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_grpc_port_in_use_and_katsubushi_spelling(daemons: DaemonFactory) -> None:
    port = free_port()
    d = daemons.start("-grpc-port", str(port), env={"GRPC_PORT": "1"})  # the flag wins
    wait_for_port(port, d.proc)
    d.wait_for_log(f"grpc://127.0.0.1:{port}")
    second = subprocess.run(
        [sys.executable, "-m", "katsubushi_py", "--worker-id", "2", "--port", str(free_port())],
        env=daemon_env(None, {"GRPC_PORT": str(port), "PATH": "/usr/bin:/bin"}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 1
    assert (
        second.stderr.strip()
        == f"katsubushi-py: error: cannot listen on grpc://127.0.0.1:{port}: address already in use"
    )


def test_without_the_grpc_extra_grpc_port_is_one_clear_line() -> None:
    hide_grpc = "import sys; sys.modules['grpc'] = None; from katsubushi_py.cli import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", hide_grpc, "--worker-id", "1", "--grpc-port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert (
        result.stderr == "katsubushi-py: error: --grpc-port needs the grpc extra: pip install 'katsubushi-py[grpc]'\n"
    )
