"""Request fields no model declares: ignored, as vLLM ignores them (a warning in the log and
their names in an X-Ignored-Fields header, so a client can see what had no effect), or a 400
with --strict-request-fields. Clients written for other servers send fields of their own
(OpenAI's newest, another server's extras); failing them all would break them for nothing."""
from __future__ import annotations

import logging
from urllib.parse import quote

from pydantic import BaseModel
from starlette.responses import Response

from tllm.serve.http.errors import bad_request

logger = logging.getLogger(__name__)
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
# A body may carry thousands of unknown names: the header and the log line name the first
# ones only (proxies refuse response heads of more than a few KiB).
MAX_NAMES_CHARS = 1024


def unknown_fields(body: BaseModel) -> list[str]:
    """The dotted paths (`messages.0.refusal`) of the fields of `body` and of its nested
    objects that no model declares. They are dropped from the body as they are found, so
    nothing downstream (a model_dump into a chat template) sees them."""
    found: list[str] = []
    _collect(body, "", found)
    return found


def _collect(value, path: str, found: list[str]) -> None:
    if isinstance(value, BaseModel):
        extra = value.__pydantic_extra__
        if extra:
            found.extend(f"{path}{name}" for name in extra)
            extra.clear()
        for name in type(value).model_fields:
            _collect(getattr(value, name), f"{path}{name}.", found)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _collect(item, f"{path}{index}.", found)


def check_fields(body: BaseModel, strict: bool) -> list[str]:
    """The unknown fields of `body`, dropped and logged; with `strict`, a 400 naming the
    first one instead."""
    names = unknown_fields(body)
    if names and strict:
        raise bad_request(f"{names[0]}: unrecognized request argument", param=names[0])
    if names:
        logger.warning("ignored request fields: %s", names_text(names))
    return names


def names_text(names: list[str]) -> str:
    """The names, percent-encoded (a JSON key may hold a newline or any character, a header
    value may not; "" for an empty one), comma-separated and cut at MAX_NAMES_CHARS."""
    text, num_shown = "", 0
    for name in names:
        item = quote(name, safe="._-~") or '""'  # an empty key: no blank end to the header
        if len(text) + len(item) + 2 > MAX_NAMES_CHARS:
            break
        text, num_shown = f"{text}, {item}" if text else item, num_shown + 1
    left = len(names) - num_shown
    if not left:
        return text
    return f"{text}, ... ({left} more)" if text else f"... ({left} more)"


def mark_ignored(response: Response, names: list[str]) -> Response:
    """`response` with the ignored fields' names in its X-Ignored-Fields header."""
    if names:
        response.headers[IGNORED_FIELDS_HEADER] = names_text(names)
    return response
