"""The plain HTTP reference for http_bench.py: the same parser (httptools) on the same loop (uvloop),
answering every request with a constant body as long as katsubushi-py's. Not an ID server.

Its figure is what the runtime, the parser and the socket calls cost per request; the difference to
katsubushi-py's HTTP front end is ours (routing, issuing, formatting, the limits, the connection glue).

    python bench/http_floor.py PORT
"""

import asyncio
import sys

import httptools
import uvloop

ONE = b"1574026156804435968"
HUNDRED = b"\n".join([ONE] * 100)


def reply(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


REPLIES = {b"/id": reply(ONE), b"/ids?n=100": reply(HUNDRED)}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


class ConstantHttp(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.out: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        self.out.append(REPLIES.get(self.url, NOT_FOUND))
        self.url = b""

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
            return
        self.transport.write(b"".join(self.out))  # type: ignore[attr-defined]
        self.out.clear()


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(ConstantHttp, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
