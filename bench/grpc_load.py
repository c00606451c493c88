"""A gRPC load client for http_bench.py: ``--concurrency`` loops of ``Generator.Fetch`` (or ``FetchMulti``)
on one channel for ``--seconds``; prints one JSON line (calls, calls/s, and whether every ID was unique).

    python bench/grpc_load.py --port PORT [--concurrency 16] [--seconds 2] [--n 0]
"""

import argparse
import asyncio
import json
import time

import grpc

from katsubushi_py.frontends import katsubushi_pb2 as pb
from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc


async def main(args: argparse.Namespace) -> dict[str, object]:
    ids: list[int] = []
    calls = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{args.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        await stub.Fetch(pb.FetchRequest(), timeout=10)
        deadline = time.monotonic() + args.seconds

        async def loop() -> None:
            nonlocal calls
            while time.monotonic() < deadline:
                if args.n:
                    ids.extend((await stub.FetchMulti(pb.FetchMultiRequest(n=args.n), timeout=10)).ids)
                else:
                    ids.append((await stub.Fetch(pb.FetchRequest(), timeout=10)).id)
                calls += 1

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
    return {"calls": calls, "calls_per_s": calls / elapsed, "ids": len(ids), "unique": len(set(ids)) == len(ids)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--n", type=int, default=0, help="FetchMulti with this n (0: Fetch)")
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
