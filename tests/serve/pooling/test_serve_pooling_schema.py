"""The pooling flags of `tllm serve`, and the OpenAPI schema of the new routes."""
from __future__ import annotations

import argparse

import pytest

from tllm.serve.cli_args import add_serve_parser, llm_arguments, server_config
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing_pooling import FakePoolingLLM

ROUTES = {"/v1/embeddings": "EmbeddingResponse", "/v1/score": "ScoreResponse",
          "/v1/rerank": "RerankResponse", "/v2/rerank": "RerankResponse",
          "/tokenize": "TokenizeResponse", "/detokenize": "DetokenizeResponse"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tllm")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_task_goes_to_the_llm_only_when_given():
    assert "task" not in llm_arguments(parse())[1]
    assert llm_arguments(parse("--task", "embed"))[1]["task"] == "embed"
    with pytest.raises(SystemExit):
        parse("--task", "dance")


def test_max_pooling_inputs():
    assert server_config(parse(), "m").max_pooling_inputs == 2048
    assert server_config(parse("--max-pooling-inputs", "10"), "m").max_pooling_inputs == 10
    assert server_config(parse("--max-pooling-inputs", "0"), "m").max_pooling_inputs is None


def test_the_schema_documents_the_routes():
    app = build_app(FakePoolingLLM(), ServerConfig(model="e"))
    try:
        schema = app.openapi()
    finally:
        app.state.ctx.close()
    for path, response in ROUTES.items():
        operation = schema["paths"][path]["post"]
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].endswith("/" + response), (path, ok)
        assert {"400", "401"} <= set(operation["responses"]), path
        assert "requestBody" in operation, path
    embedding = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert {"input", "encoding_format", "dimensions", "user", "model"} <= set(embedding)
