"""Deadlines and per-address caps on reading requests, so clients that send slowly cannot hold connections.

- Request heads: aiohttp closes a connection that has not sent a complete request head within its
  keep-alive timeout, counted from the connection's start or its previous response; `voicewire serve` sets
  it to `Settings.header_timeout_s`, so headers sent a byte at a time end there (the connection is closed
  without an answer; aiohttp also caps the head's size).
- Request bodies: `body_deadline_middleware` gives a request `body_timeout_s` from its head to deliver its
  body. A read still waiting then fails with `BodyTimeout`, answered with an OpenAI-shaped 408, and the
  connection is closed. While its body is arriving a request counts against its client address: past
  `max_bodies_per_ip` of them, one more is refused with 429 at once and its connection closed.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Final

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from voicewire.realtime.auth import AccessControl
from voicewire.realtime.openai_errors import OpenAIError

RETRY_AFTER_S: Final = 1


class BodyTimeout(TimeoutError):
    """Set on a request's body stream at its deadline: every read of it raises this. A `TimeoutError`, so
    aiohttp, reading what is left of a body after the answer, stops at once instead of lingering."""


def body_deadline_middleware(access: AccessControl) -> Middleware:
    """Enforce `body_timeout_s` and `max_bodies_per_ip` on every request that has a body (see the module).

    Memory: one counter per address with a body arriving now.
    """
    settings = access.settings
    arriving: dict[str, int] = defaultdict(int)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request.content
        if not request.body_exists or body.is_eof():
            return await handler(request)
        address = access.address(request)
        if arriving[address] >= settings.max_bodies_per_ip:
            body.set_exception(BodyTimeout())
            return _closing(OpenAIError(
                429, f"Too many requests from this address are still sending their body (limit "
                f"{settings.max_bodies_per_ip}); finish one first", code="too_many_bodies"), RETRY_AFTER_S)
        arriving[address] += 1
        counted = True

        def release() -> None:
            nonlocal counted
            if counted:
                counted = False
                arriving[address] -= 1
                if arriving[address] <= 0:
                    del arriving[address]

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
