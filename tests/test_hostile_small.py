"""Hostile clients, the smaller holes of issue 33, each against the real daemon process: a count of any
length in ``/ids?n=``, duplicate gRPC ``authorization`` metadata, the unix socket's mode from its first
instant, a non-ASCII SNI, descriptor exhaustion and the state file, and one large request's fairness."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from conftest import DaemonFactory, decode, free_port, wait_for_port
from test_auth import TOKEN
from test_auth import secrets_dir as secrets_dir  # the fixture: credential files
from test_http import fetch, start_http

BOTH_PATHS = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])


def _env(pure: bool) -> dict[str, str]:
    return {"KATSUBUSHI_NO_EXTENSIONS": "1" if pure else "0"}


@BOTH_PATHS
def test_ids_count_of_any_length_is_a_400_without_a_traceback(daemons: DaemonFactory, pure: bool) -> None:
    d, port = start_http(daemons, env=_env(pure))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    for n in ("9" * 5000, "-" + "9" * 5000, "0" * 5000 + "7", "1" * 100_000):
        if len(n) > 8 * 1024:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            status, _, body = fetch(conn, f"/ids?n={n}")
            assert status == 414  # over the request-target bound, refused before any count is read
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            continue
        status, _, body = fetch(conn, f"/ids?n={n}")
        if n.startswith("0"):
            assert status == 200 and len(body.split(b"\n")) == 7
            continue
        assert status == 400, (status, body[:200])
        error = json.loads(body)["error"]
        assert "from 1 to 1000" in error and len(error) < 200
    # A Content-Length of thousands of digits is refused as too large, not a crash.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, _, body = fetch(conn, "/id", **{"Content-Length": "9" * 5000})
    assert status in (400, 413), (status, body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, _, body = fetch(conn, "/id")
    assert status == 200 and body.isdigit()
    log = d.stderr()
    assert "Traceback" not in log and "Exceeds the limit" not in log, log


@BOTH_PATHS
def test_duplicate_authorization_metadata_is_refused_on_both_paths(
    daemons: DaemonFactory,
    secrets_dir: Path,
    pure: bool,
) -> None:
    """Two ``authorization`` values, the good token first or last: UNAUTHENTICATED whichever path
    (the compiled fast path judged the first value, the pure slow path the last), every time."""
    grpc = pytest.importorskip("grpc")
    from katsubushi_py.frontends import katsubushi_pb2 as pb
    from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

    port = free_port()
    d = daemons.start("--grpc-port", str(port), "--token-file", str(secrets_dir / "tokens"), env=_env(pure))
    wait_for_port(port, d.proc)
    good, bad = ("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer " + "y" * 20)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        generator = pb_grpc.GeneratorStub(channel)
        assert decode(generator.Fetch(pb.FetchRequest(), timeout=5, metadata=[good]).id)[1] == 7
        for metadata in ([good, bad], [bad, good], [good, good]) * 3:  # repeated: a remembered block too
            for method, request in (
                (generator.Fetch, pb.FetchRequest()),
                (generator.FetchMulti, pb.FetchMultiRequest(n=3)),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    method(request, timeout=5, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization metadata values" in refused.value.details()
        assert decode(generator.Fetch(pb.FetchRequest(), timeout=5, metadata=[good]).id)[1] == 7
    assert "Traceback" not in d.stderr()
