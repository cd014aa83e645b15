"""Text that is not Unicode: JSON lets a lone surrogate through ("\\ud800"), and SmolLM2's
tokenizer raises on it; a prompt or message holding one is a 400 naming the field, not a 500
(found by the soak script's hostile catalogue). Real text, emoji included, still works."""
from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import assert_openai_error

LONE = '"\\ud800 hi"'   # a JSON string holding a lone surrogate
CASES = [("/v1/completions", '{"model": "%s", "prompt": %s, "max_tokens": 2}', "prompt"),
         ("/v1/completions", '{"model": "%s", "prompt": ["ok", %s], "max_tokens": 2}', "prompt"),
         ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": '
          '[{"role": "user", "content": %s}]}', "messages"),
         ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": '
          '"user", "content": [{"type": "text", "text": %s}]}]}', "messages")]


@pytest.mark.slow
@pytest.mark.parametrize("path,template,param", CASES)
def test_a_lone_surrogate_is_a_400(http, path, template, param):
    response = http.post(path, content=template % (MODEL, LONE),
                         headers={"content-type": "application/json"})
    assert assert_openai_error(response, 400)["param"] == param


@pytest.mark.slow
def test_a_lone_surrogate_in_stop_is_harmless(http):
    body = '{"model": "%s", "prompt": "Hi", "max_tokens": 3, "stop": [%s]}' % (MODEL, LONE)
    response = http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text


@pytest.mark.slow
def test_real_text_still_works(http):
    response = http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "café ✓ 😀"}]})
    assert response.status_code == 200, response.text
