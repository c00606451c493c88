"""go-katsubushi's gRPC service (package ``katsubushi``: ``Generator.Fetch``, ``Generator.FetchMulti``,
``Stats.Get``) with server reflection, on the daemon's own event loop.

Needs the ``grpc`` extra (``pip install 'katsubushi-py[grpc]'``); nothing else imports this module.
The messages come from ``katsubushi.proto`` beside this file (its header says how to regenerate
``katsubushi_pb2*.py``).

The server is ``grpc.aio`` on the running loop, uvloop's included: the handlers below run on the same
thread as every other front end, so they share the issuer's plain counters without locks, and a
request that must wait for the clock awaits (:meth:`Issuer.issue_async`) without blocking anyone.

Differences from go-katsubushi: ``FetchMulti`` over 1,000 IDs is ``INVALID_ARGUMENT`` (Go says
``UNKNOWN``) with the HTTP API's text; a generation failure is ``UNAVAILABLE`` with the reason in the
details and in the ``katsubushi-reason`` trailing metadata; the server binds ``--host`` only (Go binds
every interface) and refuses a port another process holds (gRPC's default ``SO_REUSEPORT`` would let
two daemons share it).
"""

from __future__ import annotations

import errno
import socket

import grpc
from grpc_reflection.v1alpha import reflection

from ..issuing.issuer import MAX_IDS_PER_REQUEST, Failure, Issuer
from . import katsubushi_pb2 as pb
from . import katsubushi_pb2_grpc as pb_grpc
from .http import too_many_ids

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Generator"].full_name,
    pb.DESCRIPTOR.services_by_name["Stats"].full_name,
    reflection.SERVICE_NAME,
)


class GrpcListenError(RuntimeError):
    """The gRPC port cannot be bound."""


async def _abort_unavailable(context: grpc.aio.ServicerContext, failure: Failure) -> None:
    context.set_trailing_metadata((("katsubushi-reason", failure.reason),))
    await context.abort(grpc.StatusCode.UNAVAILABLE, failure.message)


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, issuer: Issuer) -> None:
        self._issuer = issuer
        self._counters = issuer.counters("grpc")

    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> pb.FetchResponse:
        ids = await self._issuer.issue_async(self._counters, 1)
        if isinstance(ids, Failure):
            await _abort_unavailable(context, ids)
        return pb.FetchResponse(id=ids[0])

    async def FetchMulti(
        self, request: pb.FetchMultiRequest, context: grpc.aio.ServicerContext
    ) -> pb.FetchMultiResponse:
        n = request.n or 1  # proto3 cannot tell 0 from unset; go-katsubushi reads both as 1
        if n > MAX_IDS_PER_REQUEST:
            self._counters.commands += 1  # counted in cmd_get, as go-katsubushi does
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, too_many_ids(n))
        ids = await self._issuer.issue_async(self._counters, n)
        if isinstance(ids, Failure):
            await _abort_unavailable(context, ids)
        return pb.FetchMultiResponse(ids=ids)


class StatsService(pb_grpc.StatsServicer):
    def __init__(self, issuer: Issuer) -> None:
        self._issuer = issuer

    async def Get(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        fields = dict(self._issuer.stats_fields())
        return pb.StatsResponse(
            **{name: fields[name] for name in pb.StatsResponse.DESCRIPTOR.fields_by_name if name in fields}
        )


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_bindable(host: str, port: int) -> None:
    """Bind the address once ourselves, so a port in use gets a plain reason (gRPC's own error only
    says "Failed to bind", after a log line of its own)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise GrpcListenError(f"cannot listen on grpc://{grpc_address(host, port)}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
                raise GrpcListenError(f"cannot listen on grpc://{grpc_address(host, port)}: {reason}") from None


async def start_grpc_server(
    issuer: Issuer, host: str, port: int, *, idle_timeout: float = 0.0, max_concurrent_rpcs: int | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start the service on ``host:port`` (port 0: a free one); returns the server and its port."""
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 64 * 1024),  # requests are a few bytes
    ]
    if idle_timeout > 0:
        options.append(("grpc.max_connection_idle_ms", int(idle_timeout * 1000)))
    if port:
        _check_bindable(host, port)
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=max_concurrent_rpcs)
    pb_grpc.add_GeneratorServicer_to_server(GeneratorService(issuer), server)
    pb_grpc.add_StatsServicer_to_server(StatsService(issuer), server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    try:
        bound = server.add_insecure_port(grpc_address(host, port))
    except RuntimeError as exc:  # lost a race for the port since the check, or something stranger
        raise GrpcListenError(f"cannot listen on grpc://{grpc_address(host, port)}: {exc}") from None
    await server.start()
    return server, bound
