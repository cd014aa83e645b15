"""Issue 31, items 5 and 6: what --api-key covers. Every route of every kind of server answers
401 without the key but the open ones of the table below (README, "Security"); the
dashboard trades ?api_key= for a session cookie that is not the key; generated files are
fetched with a signed, expiring URL; the access log never holds a secret."""
from __future__ import annotations

import logging
import re

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from starlette.routing import Mount

from tests.serve.every_server import KINDS, build
from tllm.serve.http.auth import SessionStore, UrlSigner
from tllm.serve.http.dashboard import SESSION_COOKIE
from tllm.serve.http.server import redact
from tllm.serve.testing import ServerThread

KEY = "sesame-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
# The routes that answer without the key (the README's table): probes, always; /metrics
# and the API docs unless --protect-metrics, as in vLLM.
ALWAYS_OPEN = {"/health", "/version"}
OPEN_UNLESS_PROTECTED = {"/metrics", "/docs", "/docs/assets/{name}", "/docs/oauth2-redirect",
                         "/redoc", "/openapi.json"}


def _routes(app) -> list[tuple[str, str, str]]:
    """(method, route template, a URL of it) for every route of the app."""
    routes = []
    for route in iter_route_contexts(app.routes):   # the included routers' routes too
        if isinstance(route.original_route, Mount):     # the visual server's files
            routes.append(("GET", route.path, f"{route.path}/{'0' * 32}.png"))
            continue
        url = re.sub(r"\{[^}]*\}", "x", route.path)
        routes += [(method, route.path, url) for method in sorted(route.methods - {"HEAD"})]
    return routes


@pytest.mark.parametrize("protect_metrics", [False, True], ids=["default", "protect_metrics"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_route_needs_the_key_but_the_open_ones(kind, protect_metrics):
    app = build(kind, api_key=KEY, protect_metrics=protect_metrics)
    is_open = ALWAYS_OPEN | (set() if protect_metrics else OPEN_UNLESS_PROTECTED)
    routes = _routes(app)
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=10) as client:
        wrong = []
        for method, template, url in routes:
            status = client.request(method, url).status_code
            if (status == 401) == (template in is_open):
                wrong.append(f"{method} {url} without the key: {status}")
            status = client.request(method, url, headers=BEARER).status_code
            if status == 401:
                wrong.append(f"{method} {url} with the key: 401")
        unknown = client.get("/no/such/route")
    assert not wrong, wrong
    assert unknown.status_code == 401       # guarded by default: routes added later too
    assert {"/health"} <= {template for _, template, _ in routes}


def test_the_table_covers_each_kind_s_routes():
    """The routes the table and README name exist where they should."""
    templates = {kind: {t for _, t, _ in _routes(build(kind, api_key=KEY))} for kind in KINDS}
    assert {"/metrics", "/dashboard", "/dashboard/stats.json", "/v1/models",
            "/docs/assets/{name}", "/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank",
            "/tokenize", "/detokenize", "/classify", "/v1/classify"} <= templates["text"]
    assert {"/disagg/info", "/disagg/stats"} <= templates["generation_role"]
    assert {"/files", "/v1/images/generations", "/v1/videos/{video_id}/content", "/docs",
            "/openapi.json"} <= templates["visual"]
    assert {"/router/stats", "/metrics", "/v1/embeddings", "/classify"} <= templates["router"]
    assert {"/disagg/stats", "/v1/completions", "/tokenize"} <= templates["disaggregated_front"]


# ---- the dashboard: a session cookie, never the key ----

@pytest.fixture()
def text_server():
    app = build("text", api_key=KEY)
    with ServerThread(app) as server:
        yield server, app


def test_the_dashboard_trades_the_key_for_a_session(text_server):
    server, _ = text_server
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        login = client.get("/dashboard", params={"api_key": KEY})
        assert login.status_code == 303 and login.headers["location"] == "/dashboard"
        cookie = login.headers["set-cookie"]
        assert KEY not in cookie and cookie.startswith(f"{SESSION_COOKIE}=")
        for attribute in ("HttpOnly", "SameSite=strict", "Path=/dashboard", "Max-Age="):
            assert attribute.lower() in cookie.lower(), cookie
        token = client.cookies[SESSION_COOKIE]
        assert len(token) >= 40 and token != KEY
        assert client.get("/dashboard").status_code == 200
        assert client.get("/dashboard/stats.json").json()["model"] == "fake"
        # the session is for the dashboard only
        only_cookie = {"Cookie": f"{SESSION_COOKIE}={token}"}
        assert client.get("/v1/models", headers=only_cookie).status_code == 401
        # a second login is another session
        client.cookies.clear()
        client.get("/dashboard", params={"api_key": KEY})
        assert client.cookies[SESSION_COOKIE] != token


@pytest.mark.parametrize("cookie", ["", "nope", KEY, "x" * 43])
def test_a_bad_session_token_is_refused(text_server, cookie):
    server, _ = text_server
    with httpx.Client(base_url=server.base_url, timeout=10,
                      cookies={SESSION_COOKIE: cookie}) as client:
        for path in ("/dashboard", "/dashboard/stats.json"):
            response = client.get(path)
            assert response.status_code == 401
            assert "/dashboard?api_key=" in response.json()["error"]["message"]


def test_an_expired_session_is_refused(text_server):
    server, app = text_server
    sessions = app.state.sessions
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        client.get("/dashboard", params={"api_key": KEY})
        assert client.get("/dashboard/stats.json").status_code == 200
        now = sessions.clock()
        sessions.clock = lambda: now + sessions.ttl_s + 1
        assert client.get("/dashboard/stats.json").status_code == 401


@pytest.mark.parametrize("path,params", [
    ("/dashboard", {"api_key": "nope"}), ("/dashboard/stats.json", {"api_key": KEY}),
    ("/v1/models", {"api_key": KEY}), ("/metrics", {"api_key": KEY})])
def test_the_key_in_a_query_opens_the_dashboard_page_only(path, params):
    with ServerThread(build("text", api_key=KEY, protect_metrics=True)) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            assert client.get(path, params=params).status_code == 401


def test_session_store_forgets_the_oldest_past_its_size():
    store = SessionStore(ttl_s=60, max_sessions=2)
    first, second, third = store.create(), store.create(), store.create()
    assert not store.is_valid(first) and store.is_valid(second) and store.is_valid(third)
    assert not store.is_valid(None) and not store.is_valid("")


# ---- generated files: signed, expiring URLs ----

def test_generated_files_need_the_key_or_a_valid_signature():
    app = build("visual", api_key=KEY)
    ctx = app.state.ctx
    with ServerThread(app) as server, httpx.Client(timeout=10) as client:
        name, other = ctx.save(b"\x89PNG one"), ctx.save(b"\x89PNG two")
        url = ctx.file_url(server.base_url, name)
        plain, query = url.split("?")
        assert re.fullmatch(r"expires=\d+&signature=[0-9a-f]{64}", query)
        assert client.get(url).content == b"\x89PNG one"
        assert client.get(plain, headers=BEARER).status_code == 200
        assert client.get(plain).status_code == 401
        assert client.get(f"{server.base_url}/files/{other}?{query}").status_code == 401
        tampered = query.replace("expires=", "expires=1")
        assert client.get(f"{plain}?{tampered}").status_code == 401
        expired = ctx.signer.sign(f"/files/{name}", ttl_s=-1)
        assert client.get(f"{plain}?{expired}").status_code == 401


def test_url_signer_refuses_malformed_queries():
    signer = UrlSigner()
    good = dict(p.split("=") for p in signer.sign("/files/a.png", 60).split("&"))
    assert signer.verify("/files/a.png", good)
    for bad in ({}, {**good, "expires": "²"}, {**good, "expires": "9" * 40},
                {**good, "signature": "0" * 64}, {"expires": good["expires"]}):
        assert not signer.verify("/files/a.png", bad)


# ---- the access log ----

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_access_log_never_holds_the_key():
    server = ServerThread(build("text", api_key=KEY), log_level="info")
    lines = _Lines()        # after uvicorn's Config, which replaces the logger's handlers
    access = logging.getLogger("uvicorn.access")
    access.addHandler(lines)
    try:
        with server, httpx.Client(base_url=server.base_url, timeout=10) as client:
            assert client.get("/dashboard", params={"api_key": KEY},
                              follow_redirects=True).status_code == 200
            client.get("/dashboard", params={"api_key": KEY + "x"})
            client.get("/v1/models", params={"token": KEY, "other": "1"})
            client.get("/metrics", params={"API_KEY": KEY, "signature": KEY})
    finally:
        access.removeHandler(lines)
        access.setLevel(logging.WARNING)
    assert len(lines.lines) >= 5, lines.lines
    assert not [line for line in lines.lines if KEY in line], lines.lines
    assert any("/dashboard?api_key=*** HTTP/1.1\" 303" in line for line in lines.lines)
    assert any("other=1" in line for line in lines.lines)


@pytest.mark.parametrize("text,expected", [
    ("GET /dashboard?api_key=k HTTP/1.1", "GET /dashboard?api_key=*** HTTP/1.1"),
    ("/files/a.png?expires=1&signature=ab", "/files/a.png?expires=1&signature=***"),
    ("/x?a=1&Api-Key=k&b=2", "/x?a=1&Api-Key=***&b=2"), ("/x?keys=1", "/x?keys=1"),
    ('"/x?access_token=t"', '"/x?access_token=***"')])
def test_redact(text, expected):
    assert redact(text) == expected
