"""What `--api-key` covers, on every server tllm starts (text, visual, router, disaggregated
front): an ASGI guard that answers 401 to any path but the open ones unless the request
carries `Authorization: Bearer KEY`, so that a route added later is protected by default.
Two other credentials pass on their own paths only: the dashboard's session cookie (a random
server-side token, never the key) and a signed, expiring URL for a generated file."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tllm.serve.http.errors import APIError

# Load balancers and orchestrators probe these without credentials; they say nothing private.
ALWAYS_OPEN = ("/health", "/version")
# Open as in vLLM (Prometheus scrapers, the API's own docs), unless --protect-metrics.
OPEN_UNLESS_PROTECTED = ("/metrics", "/docs", "/redoc", "/openapi.json")


def key_matches(given: str | None, api_key: str) -> bool:
    """Constant-time comparison of a presented key with the server's."""
    return given is not None and hmac.compare_digest(given.strip().encode(), api_key.encode())


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def is_under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or below it, on a segment boundary (/healthz is not /health)."""
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


@dataclass(frozen=True)
class Grant:
    """Another credential, accepted for paths under `prefix` only."""

    prefix: str
    allows: Callable[[Request], bool]
    hint: str = ""          # how a client presents it, for the 401's message


class ApiKeyGuard:
    """401 in OpenAI's shape for every request without the key, but for the open paths
    (ALWAYS_OPEN, and OPEN_UNLESS_PROTECTED unless `protect_metrics`) and the grants'."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False,
                 grants: Iterable[Grant] = ()) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = ALWAYS_OPEN + (() if protect_metrics else OPEN_UNLESS_PROTECTED)
        self.grants = tuple(grants)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allows(Request(scope)):
            await self.app(scope, receive, send)
            return
        await self._refusal(scope["path"]).response()(scope, receive, send)

    def _allows(self, request: Request) -> bool:
        path = request.url.path
        if any(is_under(path, open_path) for open_path in self.open_paths):
            return True
        if key_matches(bearer_token(request), self.api_key):
            return True
        return any(is_under(path, g.prefix) and g.allows(request) for g in self.grants)

    def _refusal(self, path: str) -> APIError:
        hints = "".join(f" ({g.hint})" for g in self.grants if g.hint and is_under(path, g.prefix))
        return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'"
                        + hints, code="invalid_api_key")


def install_api_key_guard(app, api_key: str | None, protect_metrics: bool = False,
                          grants: Iterable[Grant] = ()) -> None:
    """Put the app behind the key (nothing without one)."""
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key, protect_metrics=protect_metrics,
                           grants=tuple(grants))


class SessionStore:
    """Random session tokens for the dashboard, kept server-side (as their SHA-256) with an
    expiry; the oldest is forgotten past `max_sessions`. A restart forgets them all."""

    def __init__(self, ttl_s: float = 12 * 3600, max_sessions: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._expiries: OrderedDict[bytes, float] = OrderedDict()

    def create(self) -> str:
        now = self.clock()
        for digest in [d for d, expiry in self._expiries.items() if expiry <= now]:
            del self._expiries[digest]
        while len(self._expiries) >= self.max_sessions:
            self._expiries.popitem(last=False)
        token = secrets.token_urlsafe(32)
        self._expiries[_digest(token)] = now + self.ttl_s
        return token

    def is_valid(self, token: str | None) -> bool:
        if not token:
            return False
        digest = _digest(token)
        expiry = self._expiries.get(digest)
        if expiry is None:
            return False
        if expiry <= self.clock():
            del self._expiries[digest]
            return False
        return True


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class UrlSigner:
    """Signed, expiring URLs (HMAC-SHA256 of the path and its expiry under a random key of
    this process): a link a browser or a downloader can fetch without the API key, until
    it expires, as OpenAI's image URLs."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._key = secrets.token_bytes(32)
        self.clock = clock

    def sign(self, path: str, ttl_s: float) -> str:
        """The query string that makes `path` fetchable for `ttl_s` seconds."""
        expires = int(self.clock() + ttl_s)
        return f"expires={expires}&signature={self._signature(path, expires)}"

    def verify(self, path: str, query: Mapping[str, str]) -> bool:
        expires, signature = query.get("expires", ""), query.get("signature", "")
        is_number = expires.isascii() and expires.isdigit() and len(expires) <= 12
        if not is_number or int(expires) < self.clock():
            return False
        return hmac.compare_digest(signature.encode(),
                                   self._signature(path, int(expires)).encode())

    def _signature(self, path: str, expires: int) -> str:
        message = f"{path}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()
