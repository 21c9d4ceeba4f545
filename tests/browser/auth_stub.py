"""A stand-in for the API-key gate of the coming auth issue, serving the real demo page and client files.

The server has no API keys yet; PROTOCOL.md says a bad key is refused before the upgrade with HTTP 401.
This stub does exactly that on `/v1/audio/speech/stream` (the key is `GOOD_TOKEN`, from `?token=` or
`Authorization: Bearer`), and on `/v1/audio/speech/stream-policy` it accepts the upgrade and closes with
1008 (policy violation), the other way a server may turn a client away. Both paths let the clients'
wrong-token messages be tested now; once the real server checks keys, point those tests at it.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from voicewire.realtime.app import add_client_routes

from tests.server import free_port

GOOD_TOKEN = "right-token"
POLICY_PATH = "/v1/audio/speech/stream-policy"


def _token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth.removeprefix("Bearer ")
    return request.query.get("token")


async def _gated_stream(request: web.Request) -> web.StreamResponse:
    if _token(request) != GOOD_TOKEN:
        return web.json_response({"error": {"message": "Invalid API key", "type": "invalid_request_error",
                                            "param": None, "code": "invalid_api_key"}}, status=401)
    raise web.HTTPNotImplemented(text="the stub only refuses")


async def _policy_close(request: web.Request) -> web.StreamResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    await ws.close(code=1008, message=b"invalid token")
    return ws


class AuthStubThread:
    """Runs the stub on 127.0.0.1 in a daemon thread; `stop()` shuts it down."""

    def __init__(self) -> None:
        self.port = free_port()
        app = web.Application()
        app.router.add_get("/v1/audio/speech/stream", _gated_stream)
        app.router.add_get(POLICY_PATH, _policy_close)
        add_client_routes(app)
        self._runner = web.AppRunner(app)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._start())
            started.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        started.wait(30)

    async def _start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
