"""go-katsubushi's gRPC service (package ``katsubushi``: ``Generator.Fetch``, ``Generator.FetchMulti``,
``Stats.Get``) and server reflection, as calls in and replies out: no transport here.

The transport is :mod:`~.grpc_h2` (gRPC over HTTP/2 on the daemon's own event loop); this module says
what each call means. Messages are go-katsubushi's (``katsubushi.proto`` beside this file, its header
says how to regenerate ``katsubushi_pb2*.py``); protobuf parses and serialises them (the compiled fast
path writes its two replies itself; tests compare its bytes with protobuf's).

Differences from go-katsubushi: ``FetchMulti`` over 1,000 IDs is ``INVALID_ARGUMENT`` (Go says
``UNKNOWN``) with the HTTP API's text; a generation failure is ``UNAVAILABLE`` with the reason in the
message and in the ``katsubushi-reason`` trailer; the server binds ``--host`` only (Go binds every
interface). Reflection answers both ``grpc.reflection.v1alpha`` and ``grpc.reflection.v1`` (grpcurl
asks v1 first), from the descriptors protobuf already holds.
"""

from __future__ import annotations

from typing import NamedTuple

from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from ..auth.credentials import Credentials
from ..issuing.issuer import MAX_IDS_PER_REQUEST, Failure, Issuer
from . import katsubushi_pb2 as pb
from .http import too_many_ids

# gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html).
OK = 0
INVALID_ARGUMENT = 3
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
UNAUTHENTICATED = 16

#: Method codes: what a request's ``:path`` names. The compiled fast path knows 1 and 2.
FETCH = 1
FETCH_MULTI = 2
STATS_GET = 3
REFLECTION = 4  # a bidirectional stream; every other method is unary

REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"

METHODS: dict[bytes, int] = {
    b"/katsubushi.Generator/Fetch": FETCH,
    b"/katsubushi.Generator/FetchMulti": FETCH_MULTI,
    b"/katsubushi.Stats/Get": STATS_GET,
    f"/{REFLECTION_V1ALPHA}/ServerReflectionInfo".encode(): REFLECTION,
    f"/{REFLECTION_V1}/ServerReflectionInfo".encode(): REFLECTION,
}

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Generator"].full_name,
    pb.DESCRIPTOR.services_by_name["Stats"].full_name,
    REFLECTION_V1,
    REFLECTION_V1ALPHA,
)


class Reply(NamedTuple):
    """The end of a unary call: its one message (None: none, an error), status, message text, and
    extra trailers."""

    message: bytes | None
    status: int = OK
    text: str = ""
    trailers: tuple[tuple[bytes, bytes], ...] = ()


def unknown_method(path: bytes) -> str:
    """grpc-go's words for a path no service has."""
    service, _, method = path.decode("utf-8", "replace").lstrip("/").rpartition("/")
    if service in SERVICE_NAMES:
        return f"unknown method {method} for service {service}"
    return f"unknown service {service or method}"


_FetchResponse = pb.FetchResponse
_FetchMultiResponse = pb.FetchMultiResponse


def fetch_reply(id_: int) -> bytes:
    """``FetchResponse{id}``, serialised (protobuf's C serialiser: a Python varint loop costs three
    times as much for one ID and forty times for a hundred)."""
    return _FetchResponse(id=id_).SerializeToString()


def fetch_multi_reply(ids: list[int]) -> bytes:
    """``FetchMultiResponse{ids}``, serialised: field 1, packed varints."""
    return _FetchMultiResponse(ids=ids).SerializeToString()


def _unavailable(failure: Failure) -> Reply:
    return Reply(None, UNAVAILABLE, failure.message, ((b"katsubushi-reason", failure.reason.encode()),))


class GrpcService:
    """The calls of one daemon, shared by its gRPC connections."""

    def __init__(self, issuer: Issuer) -> None:
        self.issuer = issuer
        self.counters = issuer.counters("grpc")
        self.reflection = Reflection()
        #: --token-file: every call needs the metadata ``authorization: Bearer <token>`` (see grpc_h2).
        self.credentials: Credentials | None = None

    def unary(self, method: int, message: bytes) -> Reply:
        """The reply to a complete unary call. Raises :class:`~..issuing.errors.ClockWait` (nothing
        issued, nothing counted) when it must be retried a little later."""
        try:
            if method == FETCH:
                pb.FetchRequest.FromString(message)  # no fields, but it must be a message
                ids = self.issuer.issue(self.counters, 1)
                return _unavailable(ids) if isinstance(ids, Failure) else Reply(fetch_reply(ids[0]))
            if method == FETCH_MULTI:
                n = pb.FetchMultiRequest.FromString(message).n or 1  # proto3: 0 and unset are alike; Go reads 1
                if n > MAX_IDS_PER_REQUEST:
                    self.counters.commands += 1  # counted in cmd_get, as go-katsubushi does
                    return Reply(None, INVALID_ARGUMENT, too_many_ids(n))
                ids = self.issuer.issue(self.counters, n)
                return _unavailable(ids) if isinstance(ids, Failure) else Reply(fetch_multi_reply(ids))
            if method == STATS_GET:
                pb.StatsRequest.FromString(message)
                fields = dict(self.issuer.stats_fields())
                names = pb.StatsResponse.DESCRIPTOR.fields_by_name
                reply = pb.StatsResponse(**{name: fields[name] for name in names if name in fields})
                return Reply(reply.SerializeToString())
        except DecodeError as exc:
            return Reply(None, INTERNAL, f"grpc: error unmarshalling request: {exc}")
        return Reply(None, UNIMPLEMENTED, "not a unary method")


def _v1_file(alpha: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """reflection.proto as ``grpc.reflection.v1``: the same messages (so the same bytes on the wire)
    under the v1 package; grpcio-reflection ships only v1alpha's generated code."""
    v1 = descriptor_pb2.FileDescriptorProto()
    v1.CopyFrom(alpha)
    v1.name = "grpc/reflection/v1/reflection.proto"
    v1.package = "grpc.reflection.v1"
    v1.options.java_package = "io.grpc.reflection.v1"
    v1.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in v1.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = new + f.type_name[len(old) :]
    for service in v1.service:
        for m in service.method:
            m.input_type = new + m.input_type[len(old) :]
            m.output_type = new + m.output_type[len(old) :]
    return v1


class Reflection:
    """``ServerReflectionInfo``: one reply per request, from the files of the services served."""

    def __init__(self) -> None:
        alpha = descriptor_pb2.FileDescriptorProto.FromString(rpb.DESCRIPTOR.serialized_pb)
        files = [descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb), alpha, _v1_file(alpha)]
        self._by_name: dict[str, bytes] = {}
        self._by_symbol: dict[str, bytes] = {}
        self._messages: set[str] = set()
        for proto in files:
            raw = proto.SerializeToString()
            self._by_name[proto.name] = raw
            prefix = f"{proto.package}." if proto.package else ""
            for message in proto.message_type:
                self._add_message(prefix, message, raw)
            for enum in proto.enum_type:
                self._by_symbol[prefix + enum.name] = raw
            for service in proto.service:
                self._by_symbol[prefix + service.name] = raw
                for method in service.method:
                    self._by_symbol[f"{prefix}{service.name}.{method.name}"] = raw

    def _add_message(self, prefix: str, message: descriptor_pb2.DescriptorProto, raw: bytes) -> None:
        name = prefix + message.name
        self._by_symbol[name] = raw
        self._messages.add(name)
        for nested in message.nested_type:
            self._add_message(name + ".", nested, raw)
        for enum in message.enum_type:
            self._by_symbol[f"{name}.{enum.name}"] = raw

    def answer(self, message: bytes) -> bytes:
        """The serialised response to one serialised request (an undecodable one raises DecodeError)."""
        request = rpb.ServerReflectionRequest.FromString(message)
        response = rpb.ServerReflectionResponse(valid_host=request.host, original_request=request)
        kind = request.WhichOneof("message_request")
        found: bytes | None = None
        if kind == "list_services":
            response.list_services_response.service.extend(rpb.ServiceResponse(name=n) for n in SERVICE_NAMES)
            return response.SerializeToString()
        if kind == "file_by_filename":
            found = self._by_name.get(request.file_by_filename)
        elif kind == "file_containing_symbol":
            found = self._by_symbol.get(request.file_containing_symbol)
        elif kind == "all_extension_numbers_of_type" and request.all_extension_numbers_of_type in self._messages:
            response.all_extension_numbers_response.base_type_name = request.all_extension_numbers_of_type
            return response.SerializeToString()
        # file_containing_extension: none of these messages has extensions.
        if found is None:
            response.error_response.error_code = NOT_FOUND
            response.error_response.error_message = "not found"
        else:
            response.file_descriptor_response.file_descriptor_proto.append(found)
        return response.SerializeToString()
