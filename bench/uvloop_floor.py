"""The fastest memcached-shaped server Python and uvloop allow: one constant reply per read.

Not an ID server (it ignores what it reads). server_bench.py runs it beside katsubushi-py in the
one-key sequential scenarios to show how much of the gap to memcached is the runtime's own cost per
request (event loop, callback into Python, syscalls) and how much is ours (parsing, generating,
formatting).
"""

import asyncio
import sys

import uvloop

REPLY = b"VALUE k0 0 19\r\n1574026156804435968\r\nEND\r\n"


class ConstantReply(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.write = transport.write  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.write(REPLY)


async def main(port: int, path: str | None) -> None:
    loop = asyncio.get_running_loop()
    if path:
        server = await loop.create_unix_server(ConstantReply, path)
    else:
        server = await loop.create_server(ConstantReply, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    # uvloop_floor.py PORT [UNIX_SOCKET_PATH]: the unix socket instead of the port when given
    uvloop.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
