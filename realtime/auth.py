"""Who may talk to the server: API keys, browser origins, per-key and per-IP limits.

`AccessControl` is checked by `access_middleware` before any handler runs, so a refused WebSocket is
refused before the upgrade (an HTTP status, never a half-open session).

- API keys come from settings and/or a file (one key per line, `#` comments); the file is re-read on
  SIGHUP and when its modification time changes, so keys rotate without a restart. A key is presented as
  `Authorization: Bearer <key>` (REST and WebSocket) or `?token=<key>` (WebSocket upgrades only:
  browsers cannot set headers there). Keys are compared in constant time against every configured key
  and never logged; limits and logs use a key id (a short SHA-256 prefix).
- Browser WebSockets (requests with an `Origin` header) must come from the server's own origin or from
  `allowed_origins`; this stops cross-site WebSocket hijacking. Clients that send no `Origin` (servers,
  SDKs) are not browsers and pass.
- Per-key and per-IP caps on concurrent WebSocket sessions, and a per-key and per-IP rate of REST
  requests (a token bucket refilled continuously), answer 429 with `Retry-After`.

Open paths (no key needed): `/health`, `/ready`, the demo page `/` and `/clients/`. Everything else,
`/metrics` included, needs a key unless auth is disabled (`allow_unauthenticated`, logged as a warning).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from voicewire.realtime.openai_errors import OpenAIError
from voicewire.realtime.settings import Settings

log = logging.getLogger("voicewire.auth")

OPEN_PATHS: Final = frozenset({"/health", "/ready", "/"})
OPEN_PREFIXES: Final = ("/clients/",)
WS_PATH: Final = "/v1/audio/speech/stream"
MAX_BUCKETS: Final = 100_000


def key_id(key: str) -> str:
    """A stable, non-reversible name for a key, safe to log and to label metrics with."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyRing:
    """The configured API keys; `reload()` re-reads the key file (if any) when it changed."""

    def __init__(self, keys: tuple[str, ...], file: Path | None) -> None:
        self._static = tuple(k for k in keys if k)
        self.file = file
        self._mtime: float | None = None
        self._keys: tuple[bytes, ...] = tuple(k.encode() for k in self._static)
        if file is not None:
            self.reload(force=True)

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self, *, force: bool = False) -> bool:
        """Re-read the key file if it changed (or `force`); True when the keys were replaced.

        A missing or unreadable file keeps the previous keys (logged), so a botched rotation never
        locks everyone out silently nor opens the server.
        """
        if self.file is None:
            return False
        try:
            mtime = self.file.stat().st_mtime
            if not force and mtime == self._mtime:
                return False
            lines = self.file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            log.error("cannot read API key file %s (%s); keeping the previous keys", self.file, exc)
            return False
        file_keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
        self._keys = tuple(k.encode() for k in (*self._static, *file_keys))
        self._mtime = mtime
        log.info("API keys loaded: %d from settings, %d from %s", len(self._static), len(file_keys), self.file)
        return True

    def match(self, presented: str) -> str | None:
        """The key id of `presented` if it is a configured key, else None; constant time per key."""
        candidate = presented.encode()
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(candidate, key)
        return key_id(presented) if found else None


class RateLimited(OpenAIError):
    """429 with the seconds to wait (sent as `Retry-After`)."""

    def __init__(self, message: str, retry_after: float, code: str) -> None:
        super().__init__(429, message, code=code)
        self.retry_after = math.ceil(retry_after)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per name: `rate_per_minute` sustained, bursts up to `burst`."""

    rate_per_minute: float
    burst: float
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, name: str, now: float) -> float:
        """Take one token; 0.0 when allowed, else the seconds until one is available."""
        bucket = self._buckets.get(name)
        rate = self.rate_per_minute / 60.0
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._evict_full(now, rate)
            bucket = self._buckets[name] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / rate

    def _evict_full(self, now: float, rate: float) -> None:
        """Forget buckets that have refilled completely (they hold no state a new bucket would not);
        limits of active clients are never reset. If none has, forget the longest-idle half."""
        full_after = self.burst / rate
        for name in [n for n, b in self._buckets.items() if now - b.updated >= full_after]:
            del self._buckets[name]
        if len(self._buckets) >= MAX_BUCKETS:
            idle = sorted(self._buckets, key=lambda n: self._buckets[n].updated)
            for name in idle[: len(idle) // 2]:
                del self._buckets[name]


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request comes from: the key id (None when auth is off) and the client address."""

    key: str | None
    address: str


IDENTITY: Final = web.RequestKey("voicewire_identity", Identity)
"""Set on every request that passed `access_middleware` (absent on open paths)."""


class AccessControl:
    """Keys, origins and limits of one server (see the module docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = KeyRing(settings.api_keys, settings.api_keys_file)
        self.enabled = not settings.allow_unauthenticated
        if self.enabled and not len(self.keys) and settings.api_keys_file is None:
            raise ValueError("no API keys configured: set api_keys or api_keys_file, or allow_unauthenticated "
                             "to run an open server (development only)")
        if not self.enabled:
            log.warning("authentication is DISABLED: anyone who can reach this server can use it")
        self.sessions: dict[str, int] = defaultdict(int)
        self.rest_rate = RateLimiter(settings.rest_requests_per_minute, settings.rest_burst)

    def identify(self, request: web.Request) -> Identity:
        """Check the key (raises a 401 `OpenAIError`) and the origin (403); return who it is."""
        address = self._address(request)
        if not self.enabled:
            return Identity(None, address)
        presented = _bearer(request)
        if presented is None and request.path == WS_PATH:
            presented = request.query.get("token")
        if presented is None:
            raise OpenAIError(401, "Missing API key: send 'Authorization: Bearer <key>' (or '?token=<key>' on "
                              "a WebSocket URL)", code="missing_api_key")
        kid = self.keys.match(presented)
        if kid is None:
            raise OpenAIError(401, "Invalid API key", code="invalid_api_key")
        return Identity(kid, address)

    def check_origin(self, request: web.Request) -> None:
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is None or origin == f"{request.scheme}://{request.host}":
            return
        if origin in self.settings.allowed_origins or "*" in self.settings.allowed_origins:
            return
        raise OpenAIError(403, f"Origin {origin!r} is not allowed to open WebSockets on this server; add it to "
                          "allowed_origins", code="origin_not_allowed")

    def open_session(self, who: Identity) -> None:
        """Count a WebSocket session against its key and address caps (429 when over)."""
        s = self.settings
        caps = ((who.key, s.max_sessions_per_key, "API key"), (f"ip:{who.address}", s.max_sessions_per_ip, "address"))
        for name, cap, what in caps:
            if name is not None and self.sessions[name] >= cap:
                raise RateLimited(f"Too many concurrent sessions for this {what} (limit {cap}); close one first",
                                  1.0, "too_many_sessions")
        for name, _, _ in caps:
            if name is not None:
                self.sessions[name] += 1

    def close_session(self, who: Identity) -> None:
        for name in (who.key, f"ip:{who.address}"):
            if name is not None:
                self.sessions[name] -= 1
                if self.sessions[name] <= 0:
                    del self.sessions[name]

    def charge_rest(self, who: Identity) -> None:
        """One REST request against the key's and the address's rate (429 with Retry-After when over)."""
        now = time.monotonic()
        for name in (who.key, f"ip:{who.address}"):
            if name is None:
                continue
            wait = self.rest_rate.take(name, now)
            if wait > 0:
                raise RateLimited(f"Rate limit reached ({self.settings.rest_requests_per_minute:g} requests per "
                                  "minute); retry after the Retry-After header's seconds", wait, "rate_limited")

    def _address(self, request: web.Request) -> str:
        if self.settings.trust_forwarded_for:
            forwarded = request.headers.get("X-Forwarded-For")
            if forwarded:
                # The last entry is the one our proxy appended (the peer it saw); earlier ones are
                # whatever the client chose to send.
                return forwarded.split(",")[-1].strip()
        return request.remote or "unknown"


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get(hdrs.AUTHORIZATION)
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def access_middleware(access: AccessControl) -> Middleware:
    """Refuse unauthenticated, cross-origin and over-rate requests before any handler runs."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        try:
            who = access.identify(request)
            if path == WS_PATH:
                access.check_origin(request)
            else:
                access.charge_rest(who)
        except OpenAIError as exc:
            response = exc.response()
            if exc.status == 401:
                response.headers[hdrs.WWW_AUTHENTICATE] = "Bearer"
            if isinstance(exc, RateLimited):
                response.headers[hdrs.RETRY_AFTER] = str(exc.retry_after)
            return response
        request[IDENTITY] = who
        return await handler(request)

    return middleware
