"""Issue 31, finding 3: input that was a 500 and deserves a 400 (or, for text the server only
passes on, no error at all), over the engine double; then the server keeps serving. The
visual servers' pixel limit is tested with a stand-in model: the image is refused before
any model runs."""
from __future__ import annotations

import base64
import contextlib
import struct
import types
import zlib

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.visual.images import build_images_app
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
BASES = {COMPLETIONS: {"model": "fake", "prompt": "hi", "max_tokens": 2},
         TOKENIZE: {"model": "fake", "prompt": "hi"},
         DETOKENIZE: {"model": "fake", "tokens": [104, 105]},
         CHAT: {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2},
         RESPONSES: {"model": "fake", "input": "hi", "max_output_tokens": 2}}
DIGITS = "1" * 5000      # past Python's 4,300-digit limit on int(str)
DEEP = "[" * 100_000     # past json.loads' recursion limit
BEAMS = {"use_beam_search": True, "n": 2, "best_of": 2}


def _past_call(arguments: str) -> list[dict]:
    """A conversation with an earlier assistant tool call whose arguments are this text."""
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]


def _function_call_input(arguments: str) -> list[dict]:
    return [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]


@pytest.fixture(scope="module")
def http():
    with ServerThread(build_app(FakeLLM(), ServerConfig(model="fake"))) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            yield client


REFUSED = [
    ("logit_bias key of 5,000 digits", COMPLETIONS, {"logit_bias": {DIGITS: 1}}, "logit_bias"),
    ("chat logit_bias key of 5,000 digits", CHAT, {"logit_bias": {DIGITS: 1}}, "logit_bias"),
    ("logit_bias key of 20 digits", COMPLETIONS, {"logit_bias": {"9" * 20: 1}}, "logit_bias"),
    ("length_penalty 700", COMPLETIONS, {**BEAMS, "length_penalty": 700}, "length_penalty"),
    ("length_penalty -700", COMPLETIONS, {**BEAMS, "length_penalty": -700}, "length_penalty"),
    ("chat length_penalty 1e300", CHAT, {**BEAMS, "length_penalty": 1e300}, "length_penalty"),
    ("function_call arguments of 5,000 digits", RESPONSES,
     {"input": _function_call_input(DIGITS)}, "input"),
    ("function_call arguments nested 100,000 deep", RESPONSES,
     {"input": _function_call_input(DEEP)}, "input"),
    ("detokenize id of 20 digits", DETOKENIZE, {"tokens": [10**20]}, "tokens"),
]


@pytest.mark.parametrize("path,fields,param", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_refused_with_a_400_naming_the_field(http, path, fields, param):
    error = assert_openai_error(http.post(path, json={**BASES[path], **fields}), 400)
    assert error["param"] == param, error
    assert http.post(COMPLETIONS, json=BASES[COMPLETIONS]).status_code == 200


@pytest.mark.parametrize("path", [CHAT, TOKENIZE])
@pytest.mark.parametrize("arguments", [DIGITS, DEEP], ids=["5,000 digits", "deep nesting"])
def test_chat_history_arguments_json_cannot_hold_pass_as_text(http, arguments, path):
    """A past call's arguments that do not parse go to the template as text, as other
    non-JSON arguments do (in /tokenize's messages too)."""
    body = {**BASES[path], "prompt": None} if path == TOKENIZE else BASES[path]
    response = http.post(path, json={**body, "messages": _past_call(arguments)})
    assert response.status_code == 200, response.text


# ---- the visual servers' pixel limit ----

def png_header(width: int, height: int, pixels: bytes = b"") -> bytes:
    """A PNG stating width x height, with `pixels` (filtered rows) as its data: a few bytes
    can state 20,000 x 20,000 (PIL's own bomb check refuses that; 9,000 x 9,000 it takes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)   # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def visual(tmp_path_factory):
    """Per route, a client of a visual server over a stand-in model that takes an image
    (the layered image model's route) or makes videos from one; nothing here reaches the
    model (every request is refused first)."""
    clients, apps = {}, []
    with contextlib.ExitStack() as stack:
        for path, makes_video in (("/v1/videos", True), ("/v1/images/generations", False)):
            gen = types.SimpleNamespace(takes_image=True, makes_video=makes_video)
            config = ServerConfig(model="visual", max_image_pixels=64 * 64)
            apps.append(build_images_app(gen, config,
                                         files_dir=tmp_path_factory.mktemp("files")))
            server = stack.enter_context(ServerThread(apps[-1]))
            clients[path] = stack.enter_context(httpx.Client(base_url=server.base_url,
                                                             timeout=30))
        yield clients
    for app in apps:
        app.state.ctx.close()


IMAGES = [("20,000 x 20,000 (PIL's bomb)", png_header(20_000, 20_000), "400,000,000 pixels"),
          ("9,000 x 9,000 (81 MP)", png_header(9_000, 9_000), "9000 x 9000"),
          ("65 x 64, one row past the limit", png_header(65, 64), "65 x 64")]


@pytest.mark.parametrize("path,field", [("/v1/videos", "input_reference"),
                                        ("/v1/images/generations", "image")])
@pytest.mark.parametrize("image,what", [c[1:] for c in IMAGES], ids=[c[0] for c in IMAGES])
def test_an_image_past_the_pixel_limit_is_a_400(visual, path, field, image, what):
    response = visual[path].post(path, json={"prompt": "a fox", field: b64(image)})
    error = assert_openai_error(response, 400)
    assert (error["param"], error["code"]) == (field, "image_too_large"), error
    assert what in error["message"] and "--max-image-pixels" in error["message"]
    assert "4,096 pixels" in error["message"]
    assert visual[path].get("/health").status_code == 200


@pytest.mark.parametrize("path,field", [("/v1/videos", "input_reference"),
                                        ("/v1/images/generations", "image")])
def test_a_header_without_its_pixels_is_not_an_image(visual, path, field):
    response = visual[path].post(path, json={"prompt": "a fox",
                                             field: b64(png_header(8, 8))})
    error = assert_openai_error(response, 400)
    assert error["param"] == field and "PNG or JPEG" in error["message"]


def test_the_image_within_the_limit_decodes():
    from tllm.serve.openai.image_input import decode_image
    rows = b"".join(b"\x00" + b"\x80" * (64 * 3) for _ in range(64))
    assert decode_image(b64(png_header(64, 64, rows)), "image", 64 * 64).size == (64, 64)
