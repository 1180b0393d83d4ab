"""A TCP proxy that makes a loopback S3 server behave like a remote store: each connection
capped in bandwidth (a token bucket per connection and direction) and every response
delayed by a fixed latency.

Why: real S3 serves one connection at roughly 100 MB/s however fast the store is, which is
why parallel parts pay off; a server on loopback is limited only by its own CPU, so a
single stream there is as fast as eight. Through this proxy (cap and latency well below
the server's own ceiling) a client's parallelism shows as it would against S3.

The latency is added to the first response bytes after each request (the proxy sees TCP,
not HTTP: a request is whatever the client sends after the server has spoken). A PUT
that waits for ``100 Continue`` pays it twice, as it pays two round trips against S3.

    python benchmarks/throttle_proxy.py --upstream 127.0.0.1:9000 [--port P] [--MBps 20] [--latency-ms 20]

``benchmarks/objstore_bench.py --throttle`` runs it as a subprocess (its own core, not the
client's GIL) in front of the server it starts.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

CHUNK = 64 << 10  # bytes per read: 3 ms at 20 MB/s, so pacing stays smooth
BURST_S = 0.01    # a bucket holds 10 ms of its rate: no connection runs ahead of its cap


class TokenBucket:
    """At most ``rate`` bytes per second, with ``BURST_S`` worth of credit."""

    def __init__(self, rate: float) -> None:
        self.rate, self.free_at = rate, time.monotonic()

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        self.free_at = max(self.free_at, now - BURST_S) + nbytes / self.rate
        if self.free_at > now:
            await asyncio.sleep(self.free_at - now)


class Connection:
    """One client connection and its upstream one: two pumps, each through its own bucket;
    a response is held ``latency_s`` when it starts."""

    def __init__(self, rate: float, latency_s: float) -> None:
        self.up, self.down = TokenBucket(rate), TokenBucket(rate)
        self.latency_s, self.awaiting_response = latency_s, False

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bool) -> None:
        bucket = self.up if request else self.down
        try:
            while chunk := await reader.read(CHUNK):
                if request:
                    self.awaiting_response = True
                elif self.awaiting_response:
                    self.awaiting_response = False
                    await asyncio.sleep(self.latency_s)
                await bucket.take(len(chunk))
                writer.write(chunk)
                await writer.drain()
        except OSError:  # either side reset: the other one is closed below
            pass
        finally:
            writer.close()


async def serve(port: int, upstream: tuple[str, int], rate: float, latency_s: float) -> None:
    """Accept on loopback ``port``, one upstream connection per client connection, until killed."""
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:
            client_w.close()
            return
        conn = Connection(rate, latency_s)
        await asyncio.gather(conn.pump(client_r, server_w, request=True), conn.pump(server_r, client_w, request=False))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT of the server to front")
    p.add_argument("--port", type=int, required=True, help="loopback port to listen on")
    p.add_argument("--MBps", type=float, default=20.0, help="cap per connection and direction, MB/s (default 20)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added to each response, ms (default 20)")
    args = p.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    try:
        asyncio.run(serve(args.port, (host, int(port)), args.MBps * 1e6, args.latency_ms / 1000))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
