"""Deadlines and per-address caps on reading requests, so clients that send slowly cannot hold connections.

- Request heads: aiohttp closes a connection that has not sent a complete request head within its
  keep-alive timeout, counted from the connection's start or its previous response; `voicewire serve` sets
  it to `Settings.header_timeout_s`, so headers sent a byte at a time end there (the connection is closed
  without an answer; aiohttp also caps the head's size).
- Request bodies: `body_deadline_middleware` gives a request `body_timeout_s` from its head to deliver its
  body. A read still waiting then fails with `BodyTimeout`, answered with an OpenAI-shaped 408, and the
  connection is closed.
- Per address: a request counts against its client address while its head or its body is still arriving
  (`ArrivingRequests`); past `max_bodies_per_ip` of them, one more is refused with 429 at once and its
  connection closed. A head or body that arrives whole in one read is never counted. aiohttp shows a
  request to the app only once its head is parsed, so heads are counted one layer down: `CountingSite`
  listens like aiohttp's `TCPSite`, and each connection's protocol (`HeadCounting`, around aiohttp's own)
  watches the bytes of a head until its blank line, and hands the request over to the body count when
  `head_arrived_middleware` (the outermost) sees it. Behind a trusted proxy (`trust_forwarded_for`) the
  client's address is written in the head itself, so heads are not counted (the proxy sends each head
  whole, and its own header timeout applies); bodies are.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Final, cast

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from voicewire.realtime.auth import AccessControl
from voicewire.realtime.openai_errors import OpenAIError

RETRY_AFTER_S: Final = 1
HEAD_END: Final = b"\r\n\r\n"


class BodyTimeout(TimeoutError):
    """Set on a request's body stream at its deadline: every read of it raises this. A `TimeoutError`, so
    aiohttp, reading what is left of a body after the answer, stops at once instead of lingering."""


class ArrivingRequests:
    """Requests whose head or body is still arriving, per client address, capped at `limit` each, and the
    connections a `CountingSite` accepted (to find one from its request).

    Memory: one counter per address with a request arriving now, one entry per open connection.
    """

    def __init__(self, limit: int, *, heads: bool = True) -> None:
        self.limit = limit
        self.heads = heads
        """Whether `CountingSite` counts heads (False behind a trusted proxy; see the module)."""
        self._counts: dict[str, int] = {}
        self.connections: dict[asyncio.BaseTransport, HeadCounting] = {}

    def enter(self, address: str) -> bool:
        """Count one more request from `address`; False (nothing counted) when it already has `limit`."""
        count = self._counts.get(address, 0)
        if count >= self.limit:
            return False
        self._counts[address] = count + 1
        return True

    def leave(self, address: str) -> None:
        count = self._counts.get(address, 0) - 1
        if count > 0:
            self._counts[address] = count
        else:
            self._counts.pop(address, None)

    def arriving(self, address: str) -> int:
        """Requests from `address` counted now."""
        return self._counts.get(address, 0)

    def refusal(self) -> OpenAIError:
        return OpenAIError(429, f"Too many requests from this address are still being sent (limit {self.limit}); "
                           "finish one first", code="too_many_bodies")


ARRIVING: Final = web.AppKey("voicewire_arriving_requests", ArrivingRequests)


class HeadCounting(asyncio.Protocol):
    """aiohttp's protocol for one connection, wrapped: between requests it watches the bytes of the next
    request's head (ignoring the empty lines a client may send first) up to the blank line that ends it. A
    head still incomplete after a read counts against the connection's address in `arriving` until it
    completes or the connection closes; one that would pass the cap is answered 429 and its connection
    closed, unread. From its head's end until `request_done` (its handler returned and its body arrived),
    the bytes are the request's and are passed on unwatched."""

    def __init__(self, inner: asyncio.Protocol, arriving: ArrivingRequests) -> None:
        self.inner = inner
        self.arriving = arriving
        self.transport: asyncio.Transport | None = None
        self.address = ""
        self.watching = True
        """Between requests, or in a head: the bytes are watched for a head's end."""
        self.counted = False
        self._started = False
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without the subclass
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) else "unknown"
        self.arriving.connections[self.transport] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.watching and self._head_incomplete_after(data) and not self.counted:
            if not self.arriving.enter(self.address):
                self._refuse()
                return
            self.counted = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        if self.transport is not None:
            self.arriving.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def head_done(self) -> None:
        """The app has the request (its head was parsed): its bytes are the request's until `request_done`."""
        self.watching = False
        self._uncount()

    def request_done(self) -> None:
        """The request is over (handler returned, body read): the next bytes begin the next head."""
        self.watching = True
        self._started = False
        self._tail = b""

    def _head_incomplete_after(self, data: bytes) -> bool:
        """Whether, with `data`, a head has begun and not ended (when it ends, the rest is the request's)."""
        if not self._started:
            data = data.lstrip(b"\r\n")
            if not data:
                return False
            self._started = True
        seen = self._tail + data
        if HEAD_END in seen:
            self.head_done()
            return False
        self._tail = seen[-(len(HEAD_END) - 1):]
        return True

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.arriving.leave(self.address)

    def _refuse(self) -> None:
        assert self.transport is not None
        self.watching = False
        error = self.arriving.refusal()
        body = json.dumps(error.body()).encode()
        status = HTTPStatus(error.status)
        head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\nReferrer-Policy: no-referrer\r\n"
                "Connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()


class CountingSite(web.BaseSite):
    """A TCP listener like aiohttp's `TCPSite` whose connections count their request heads against their
    address (`HeadCounting`), for an app made by `create_app`; a plain one for any other app, or when the
    app trusts `X-Forwarded-For` (see the module)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner)
        self._app = runner.app
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        arriving = self._app.get(ARRIVING)
        factory: Callable[[], asyncio.Protocol] = server
        if arriving is not None and arriving.heads:
            factory = functools.partial(_counting, server, arriving)
        self._server = await asyncio.get_running_loop().create_server(factory, self._host, self._port,
                                                                      backlog=self._backlog)


def _counting(server: web.Server, arriving: ArrivingRequests) -> HeadCounting:
    return HeadCounting(server(), arriving)


def head_arrived_middleware(arriving: ArrivingRequests) -> Middleware:
    """The outermost middleware: tells the connection's `HeadCounting` that its request's head has arrived
    (uncounting it), and when the request is over, that the next bytes are a new head."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = None if request.transport is None else arriving.connections.get(request.transport)
        if connection is None:
            return await handler(request)
        connection.head_done()
        try:
            return await handler(request)
        finally:
            if request.content.is_eof():
                connection.request_done()
            else:
                request.content.on_eof(connection.request_done)

    return middleware


def body_deadline_middleware(access: AccessControl, arriving: ArrivingRequests) -> Middleware:
    """Enforce `body_timeout_s`, and count a body still arriving in `arriving` (see the module)."""
    settings = access.settings

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request.content
        if not request.body_exists or body.is_eof():
            return await handler(request)
        address = access.address(request)
        if not arriving.enter(address):
            body.set_exception(BodyTimeout())
            return _closing(arriving.refusal(), RETRY_AFTER_S)
        counted = True

        def release() -> None:
            nonlocal counted
            if counted:
                counted = False
                arriving.leave(address)

        def expire() -> None:
            if not body.is_eof():
                body.set_exception(BodyTimeout())
                release()

        body.on_eof(release)
        timer = asyncio.get_running_loop().call_later(settings.body_timeout_s, expire)
        try:
            return await handler(request)
        except BodyTimeout:
            return _closing(OpenAIError(
                408, f"The request body did not arrive within {settings.body_timeout_s:g} s of its headers",
                code="request_timeout"))
        finally:
            timer.cancel()
            release()

    return middleware


def _closing(error: OpenAIError, retry_after: int | None = None) -> web.Response:
    """`error` as a response that closes the connection (its body is not read further)."""
    response = error.response()
    response.force_close()
    if retry_after is not None:
        response.headers[hdrs.RETRY_AFTER] = str(retry_after)
    return response
