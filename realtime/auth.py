"""Who may talk to the server: API keys, browser origins, per-key and per-IP limits.

`AccessControl` is checked by `access_middleware` before any handler runs, so a refused WebSocket is
refused before the upgrade (an HTTP status, never a half-open session).

- API keys come from settings and/or a file (one key per line, `#` comments); the file is re-read on
  SIGHUP and when its modification time changes, so keys rotate without a restart (`KeyRing` says what a
  missing file and a removed key do). A key is presented as `Authorization: Bearer <key>` (REST and
  WebSocket) or `?token=<key>` (WebSocket upgrades only: browsers cannot set headers there). Keys are
  compared in constant time against every configured key and never logged; limits and logs use a key id
  (a short SHA-256 prefix), and `AccessLog` redacts `?token=` from the access log
  (and keeps the `/health` and `/ready` probes at DEBUG).
- Browser requests (those with an `Origin` header) that open a WebSocket or change state (POST, PUT, PATCH,
  DELETE) must come from the server's own origin or from `allowed_origins` (403): this stops cross-site
  WebSocket hijacking and cross-site forms on an open server. The own origin is judged by the address the
  connection reached, never by the `Host` header (DNS rebinding). Routes that take JSON refuse other body
  types (415), so a page cannot send them a form or `text/plain` body. Clients that send no `Origin`
  (servers, SDKs) are not browsers and pass.
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
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from aiohttp import hdrs, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.typedefs import Handler, Middleware
from voicewire.realtime.openai_errors import OpenAIError
from voicewire.realtime.settings import Settings
from yarl import URL

log = logging.getLogger("voicewire.auth")

PROBE_PATHS: Final = frozenset({"/health", "/ready"})
"""Health and readiness probes: open, and logged at DEBUG by `AccessLog`."""
OPEN_PATHS: Final = PROBE_PATHS | {"/"}
LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
STATE_CHANGING: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FORM_PATHS: Final = frozenset({"/v1/audio/voices"})
"""Routes that take a form body (`multipart/form-data`); every other route with a body takes JSON."""
TOKEN_IN_QUERY: Final = re.compile(r"([?&]token=)[^&#\s\"]*", re.IGNORECASE)
OPEN_PREFIXES: Final = ("/clients/",)
WS_PATH: Final = "/v1/audio/speech/stream"
MAX_BUCKETS: Final = 100_000


def key_id(key: str) -> str:
    """A stable, non-reversible name for a key, safe to log and to label metrics with."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Reload:
    """What one `KeyRing.reload()` did: `changed` when the keys were replaced, `failed` when the file could
    not be read (the last good keys stay), `revoked` the key ids accepted before and not any more."""

    changed: bool = False
    failed: bool = False
    revoked: frozenset[str] = frozenset()


class KeyRing:
    """The configured API keys; `reload()` re-reads the key file (if any) when it changed.

    The file is the source of truth for its keys: a key removed from it is revoked at the next reload, and
    a file with no keys left revokes all of them (keys from settings stay). A file that is missing or
    unreadable is an error, never an empty list: the last good keys stay in force (`stale` is true) and
    the failure is logged at ERROR when it starts and at every forced reload (SIGHUP), so a botched
    rotation neither locks everyone out nor opens the server. At start-up there is no last good set, so
    an unreadable file raises `ValueError`.
    """

    def __init__(self, keys: tuple[str, ...], file: Path | None) -> None:
        self._static = tuple(k for k in keys if k)
        self.file = file
        self.stale = False
        """True while the file cannot be read and the last good keys are kept."""
        self._mtime: float | None = None
        self._keys: tuple[bytes, ...] = tuple(k.encode() for k in self._static)
        self._ids = frozenset(key_id(k) for k in self._static)
        if file is not None and self.reload(force=True).failed:
            raise ValueError(f"cannot read the API key file {file}")

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self, *, force: bool = False) -> Reload:
        """Re-read the key file if it changed, if the last read failed, or if `force`d (see the class)."""
        if self.file is None:
            return Reload()
        try:
            mtime = self.file.stat().st_mtime
            if not force and not self.stale and mtime == self._mtime:
                return Reload()
            lines = self.file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            if force or not self.stale:
                log.error("cannot read API key file %s (%s); the %d keys loaded before stay in force until it "
                          "can be read", self.file, exc, len(self._keys))
            self.stale = True
            return Reload(failed=True)
        self.stale = False
        file_keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
        keys = (*self._static, *file_keys)
        ids = frozenset(key_id(k) for k in keys)
        revoked = self._ids - ids
        self._keys = tuple(k.encode() for k in keys)
        self._ids = ids
        self._mtime = mtime
        log.info("API keys loaded: %d from settings, %d from %s; %d revoked", len(self._static), len(file_keys),
                 self.file, len(revoked))
        if not keys:
            log.warning("API key file %s holds no keys: every request will be refused", self.file)
        return Reload(changed=True, revoked=revoked)

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
        address = self.address(request)
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
        """403 unless the request's `Origin` (if any) is allowed (see `origin_allowed`)."""
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is None or self.origin_allowed(origin, request):
            return
        what = "open WebSockets on" if request.path == WS_PATH else "send requests to"
        raise OpenAIError(403, f"Origin {origin!r} is not allowed to {what} this server; add it to "
                          "allowed_origins", code="origin_not_allowed")

    def origin_allowed(self, origin: str, request: web.Request) -> bool:
        """`origin` is listed in `allowed_origins` (or "*" is), or it is this server's own origin.

        The own origin is recognised without trusting the request's `Host` header (a DNS-rebinding page
        controls it): `http://NAME:PORT` where PORT is the port the connection actually arrived on and NAME
        is a loopback name (`localhost`, `127.0.0.1`, `[::1]`), the address the connection arrived at, or the
        configured `host`. Any other name under which browsers reach the server (its public name behind a
        proxy, say) must be listed in `allowed_origins`.
        """
        allowed = self.settings.allowed_origins
        if origin in allowed or "*" in allowed:
            return True
        try:
            url = URL(origin)
            port = url.port
        except ValueError:
            return False
        local = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if url.scheme != "http" or url.host is None or not isinstance(local, tuple) or port != local[1]:
            return False
        return url.host.lower() in {*LOOPBACK_NAMES, str(local[0]).lower(), self.settings.host.lower()}

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

    def address(self, request: web.Request) -> str:
        """The client address limits count against (see `trust_forwarded_for`)."""
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


def _check_body_type(request: web.Request) -> None:
    """415 for a body that is not JSON on a route that takes JSON (all but `FORM_PATHS`). A body without a
    `Content-Type` is taken as JSON (SDKs and servers send no browser-made form)."""
    if request.method not in STATE_CHANGING or request.path in FORM_PATHS or not request.body_exists:
        return
    if hdrs.CONTENT_TYPE not in request.headers:
        return
    kind = request.content_type
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise OpenAIError(415, f"Content-Type {kind!r} is not accepted here: send a JSON body with "
                          "'Content-Type: application/json'", code="unsupported_media_type")


def access_middleware(access: AccessControl) -> Middleware:
    """Refuse unauthenticated, cross-origin and over-rate requests, and non-JSON bodies on JSON routes,
    before any handler runs. A browser page on another site can make simple requests (forms, `text/plain`)
    without asking; state-changing ones from an origin that is not allowed are refused (403), as are
    WebSockets, and JSON routes take no form or text body at all (415)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        try:
            who = access.identify(request)
            if path == WS_PATH or request.method in STATE_CHANGING:
                access.check_origin(request)
            if path != WS_PATH:
                access.charge_rest(who)
                _check_body_type(request)
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


def redact_tokens(url: str) -> str:
    """`url` (absolute, or a path with its query) with the value of every `token` query parameter replaced
    by `REDACTED`, however its name is written (`Token`, `%74oken`)."""
    try:
        parsed = URL(url)
        if any(name.lower() == "token" for name in parsed.query):
            url = str(parsed.with_query([(name, "REDACTED" if name.lower() == "token" else value)
                                         for name, value in parsed.query.items()]))
    except ValueError:
        pass
    return TOKEN_IN_QUERY.sub(r"\1REDACTED", url)


class AccessLog(AbstractAccessLogger):
    """aiohttp's access line (address, request line, status, bytes, seconds, Referer, User-Agent) with
    `?token=` keys redacted from the request line and the Referer. Requests to `PROBE_PATHS` go to DEBUG,
    every other request to INFO: load balancers poll them every few seconds and at INFO they would bury
    every real request (`--log-level debug` shows them). Pass it as `access_log_class` to `web.run_app` or
    `web.AppRunner`."""

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        version = request.version
        level = logging.DEBUG if request.path in PROBE_PATHS else logging.INFO
        self.logger.log(level, '%s "%s %s HTTP/%d.%d" %d %d %.3f "%s" "%s"', request.remote or "-", request.method,
                        redact_tokens(request.path_qs), version.major, version.minor, response.status,
                        response.body_length, time, redact_tokens(request.headers.get(hdrs.REFERER, "-")),
                        request.headers.get(hdrs.USER_AGENT, "-"))
