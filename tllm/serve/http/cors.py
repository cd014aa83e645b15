"""CORS for browser clients (`--allowed-origins`): off unless asked, so a web page of another
origin cannot read the server's answers. When on, preflights are answered before the API-key
check (a browser sends them without credentials); the real request still needs the key."""
from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware

from tllm.serve.openai.request_fields import IGNORED_FIELDS_HEADER

# Headers a page's script may read besides the CORS-safelisted ones.
EXPOSED_HEADERS = [IGNORED_FIELDS_HEADER, "X-Request-Id", "Retry-After"]


def add_cors_args(group) -> None:
    group.add_argument("--allowed-origins", action="append", metavar="ORIGINS",
                       help="answer CORS requests from these origins (comma-separated or "
                            "repeated, e.g. http://localhost:3000; '*' for any); default: "
                            "no CORS headers. The API key still guards every request")


def parse_origins(values: list[str] | None) -> tuple[str, ...]:
    """The origins of every --allowed-origins flag, in order, without blanks or repeats."""
    origins = (o.strip().rstrip("/") for value in values or () for o in value.split(","))
    return tuple(dict.fromkeys(o for o in origins if o))


def install_cors(app, origins: tuple[str, ...]) -> None:
    """The outermost middleware, when `origins` are given: a preflight never reaches the
    API-key guard, and every answer (a 401 or a 500 too) carries the CORS headers."""
    if not origins:
        return
    # No credentials (cookies): clients send the key in Authorization, which needs none.
    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                       allow_headers=["*"], expose_headers=EXPOSED_HEADERS)
