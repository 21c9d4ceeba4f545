"""`x-request-id` on every HTTP response, as OpenAI's API sends it (its SDKs and LiveKit's plugin read it).

A client that sends a sane `X-Request-Id` (1-128 characters of letters, digits and `._:-`) gets it back, so
one id follows a request through proxies and logs; anything else (absent, too long, other characters that
could forge log lines or headers) is replaced by a fresh `req_<32 hex digits>`. The header is set in
`on_response_prepare`, so it is on every response the app sends: JSON, audio streams, errors, static
files and the WebSocket upgrade.
"""

from __future__ import annotations

import re
import uuid
from typing import Final

from aiohttp import web

HEADER: Final = "X-Request-Id"
_SANE: Final = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_CHOSEN: Final = web.RequestKey("voicewire_request_id", str)


def request_id(request: web.Request) -> str:
    """The id of `request`: the client's when sane, else a new one (the same one for every call)."""
    if _CHOSEN in request:
        return request[_CHOSEN]
    sent = request.headers.get(HEADER, "")
    chosen = sent if _SANE.fullmatch(sent) else f"req_{uuid.uuid4().hex}"
    request[_CHOSEN] = chosen
    return chosen


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: stamp the response with the request's id."""
    response.headers[HEADER] = request_id(request)
