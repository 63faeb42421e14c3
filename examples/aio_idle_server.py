"""An asyncio line-echo server whose connections close after an idle timeout.

Every connection holds one timer on the loop's timing wheel (``timewheel.aio``); every
line it receives resets that timer (cancel + schedule, O(1), nothing left in the loop's
heap). A request handler also bounds its own work with ``aio.timeout``.

Run it: ``python examples/aio_idle_server.py [--uvloop] [--idle SECONDS]``. It serves on
127.0.0.1 (a free port), drives two clients itself (one chatty, one that goes quiet),
prints what happened and exits; nothing runs longer than a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, cast

from timewheel import aio


class EchoProtocol(asyncio.Protocol):
    """Echo each line back; close the connection after ``idle`` seconds of silence."""

    def __init__(self, idle: float, closed: list[str]) -> None:
        self.idle = idle
        self.closed = closed
        self.timer: Any = None
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.timer = aio.call_later(self.idle, self.on_idle)

    def data_received(self, data: bytes) -> None:
        self.timer.cancel()  # the idle-timeout reset: O(1) on the wheel
        self.timer = aio.call_later(self.idle, self.on_idle)
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        assert self.transport is not None
        for line in lines:
            self.transport.write(line.upper() + b"\n")

    def on_idle(self) -> None:
        self.closed.append("idle")
        assert self.transport is not None
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()


async def client(port: int, messages: int, pause: float) -> tuple[int, bool]:
    """Send ``messages`` lines ``pause`` seconds apart; return (echoes, closed by server)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    echoes = 0
    try:
        for i in range(messages):
            writer.write(f"hello {i}\n".encode())
            async with aio.timeout(2.0):  # a reply must come within 2 s
                if await reader.readline():
                    echoes += 1
            await aio.sleep(pause)
        # then go quiet: the server closes us after its idle timeout
        async with aio.timeout(5.0):
            closed = await reader.read() == b""
    finally:
        writer.close()
    return echoes, closed


async def main(idle: float) -> None:
    loop = asyncio.get_running_loop()
    closed: list[str] = []
    server = await loop.create_server(lambda: EchoProtocol(idle, closed), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        start = loop.time()
        chatty, quiet = await asyncio.gather(
            client(port, messages=6, pause=idle / 3),  # keeps resetting its timeout
            client(port, messages=1, pause=0),
        )
        took = loop.time() - start
    print(f"chatty client: {chatty[0]} echoes, closed by the idle timeout: {chatty[1]}")
    print(f"quiet client: {quiet[0]} echo, closed by the idle timeout: {quiet[1]}")
    print(f"idle closes: {len(closed)}, in {took:.2f} s")
    assert chatty == (6, True) and quiet == (1, True) and closed == ["idle", "idle"]
    # the chatty client outlived several idle periods: its resets kept it open
    assert took >= 6 * idle / 3


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument("--idle", type=float, default=0.3, help="idle timeout (seconds)")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(main(args.idle))
    else:
        asyncio.run(main(args.idle))
