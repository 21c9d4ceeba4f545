"""Frames written several at a time (`realtime/frames.py`) reach a real aiohttp client whole and in order,
at every length boundary of the frame header, on asyncio's loop and uvloop's (the server's), and aiohttp's own
frames (its close) still follow them cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
import uvloop
from aiohttp import WSMsgType, web
from voicewire.realtime.frames import write_frames

FRAMES: list[str | bytes] = [
    "", "é" * 62, "x" * 126, bytes(range(256)) * 255 + b"\x00" * 255, bytes(65536), b"\x01" * 70000, "done",
]
"""Text and binary frames of 0, 124 (UTF-8), 126, 65535, 65536 and 70000 bytes: each header form and its
edges."""


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_frames_written_together_arrive_whole_and_in_order(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def main() -> None:
        async def handler(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(compress=False)
            await ws.prepare(request)
            await ws.receive()  # the client's go
            assert request.transport is not None
            write_frames(request.transport, FRAMES[:3])
            write_frames(request.transport, FRAMES[3:])
            await ws.close()
            return ws

        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as http, http.ws_connect(f"http://127.0.0.1:{port}/") as ws:
                await ws.send_str("go")
                got: list[str | bytes] = []
                async with asyncio.timeout(30):
                    async for msg in ws:
                        assert msg.type in (WSMsgType.TEXT, WSMsgType.BINARY), msg
                        got.append(msg.data)
                assert got == FRAMES
                assert ws.close_code == aiohttp.WSCloseCode.OK
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())
