"""Clients for katsubushi daemons (ours and go-katsubushi): IDs as integers, never a stalled caller.

    from katsubushi_py.client import Client, AsyncClient

    ids = Client(["10.0.0.1:11212", "10.0.0.2:11212"], timeout=0.5)
    one = ids.fetch()             # an int
    batch = ids.fetch_many(100)   # 100 increasing ints, one round trip

:class:`Client` (blocking, on pymemcache; threads and ``fork()`` safe) and :class:`AsyncClient`
(asyncio) share the failover rules of :mod:`.servers` and the reply checks of :mod:`.replies`.
"""

from .aio import AsyncClient
from .replies import ReplyError, ServerErrorReply
from .servers import DEFAULT_SERVERS, SERVERS_ENV, AllServersFailed, ClientError, ServerStatus, parse_servers
from .sync import Client

__all__ = [
    "DEFAULT_SERVERS",
    "SERVERS_ENV",
    "AllServersFailed",
    "AsyncClient",
    "Client",
    "ClientError",
    "ReplyError",
    "ServerErrorReply",
    "ServerStatus",
    "parse_servers",
]
