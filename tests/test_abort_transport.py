"""Dropping a connection works on every event loop the server runs on: asyncio's and uvloop's (the one
`voicewire serve` uses), whose transports are not registered as `asyncio.Transport` subclasses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import uvloop
from voicewire.realtime.session import abort_transport


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_abort_drops_a_real_tcp_connection_with_unsent_bytes(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def main() -> None:
        accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer)

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        served = await accepted
        served.write(b"x" * (8 << 20))  # more than the socket takes: bytes stay unsent, a close would wait
        abort_transport(served.transport)
        assert served.transport.is_closing()
        async with asyncio.timeout(30):  # a hang guard: without the abort the peer never sees the end
            try:
                while await reader.read(1 << 20):
                    pass
            except ConnectionResetError:
                pass
        writer.close()
        server.close()
        await server.wait_closed()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())
