"""gRPC (tllm/serve/grpc/tllm.proto) beside the HTTP routes on one event loop, over a tiny
random model with a byte-level tokenizer: Generate equals the HTTP completion (text and token
ids, streamed pieces and logprobs), Abort ends a running stream, Health and ModelInfo, and
bad input gets proper status codes."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import httpx
import pytest
import uvicorn

from tests.disagg.conftest import tiny_model_dir  # noqa: F401 (a fixture)
from tllm import LLM, KvCacheConfig
from tllm.serve.context import ServerConfig
from tllm.serve.grpc import tllm_pb2 as pb
from tllm.serve.grpc import tllm_pb2_grpc as pb_grpc
from tllm.serve.grpc.server import serve_with_grpc
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM


class HttpAndGrpc:
    """build_app's server and the gRPC server on one loop in a thread, as --grpc-port runs."""

    def __init__(self, llm, config: ServerConfig = ServerConfig(model="tiny")) -> None:
        self.app = build_app(llm, config)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.http_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.grpc_port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    lifespan="off"))
        self._thread = threading.Thread(target=lambda: asyncio.run(serve_with_grpc(
            self.server, self.app.state.ctx, "127.0.0.1", self.grpc_port,
            sockets=[self._socket])), daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive()
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.app.state.ctx.close()


@pytest.fixture(scope="module")
def servers(tiny_model_dir):  # noqa: F811
    llm = LLM(tiny_model_dir, max_seq_len=256, kv_cache_config=KvCacheConfig(max_tokens=2048))
    with HttpAndGrpc(llm) as both:
        yield both
    llm.shutdown()


@pytest.fixture()
def stub(servers):
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as channel:
        yield pb_grpc.GenerationStub(channel)


GREEDY = pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _http_completion(servers, prompt) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    return httpx.post(servers.http_url + "/v1/completions", json=body, timeout=60).json()


@pytest.mark.parametrize("prompt", ["the quick brown fox", [5, 17, 42, 99, 3]])
def test_generate_equals_the_http_completion(servers, stub, prompt):
    request = (pb.GenerateRequest(text=prompt, sampling=GREEDY) if isinstance(prompt, str) else
               pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=GREEDY))
    responses = list(stub.Generate(request))
    http = _http_completion(servers, prompt)["choices"][0]
    assert "".join(r.text for r in responses) == http["text"]
    logprobs = [p.logprob for r in responses for p in r.logprobs]
    assert logprobs == pytest.approx(http["logprobs"]["token_logprobs"], abs=1e-5)
    assert sum(len(r.token_ids) for r in responses) == 12
    assert responses[-1].finish_reason == "length" and responses[-1].completion_tokens == 12
    assert all(len(p.top) >= 2 for r in responses for p in r.logprobs)


def test_abort_ends_a_running_stream(stub):
    stream = stub.Generate(pb.GenerateRequest(
        request_id="long", text="hello", sampling=pb.SamplingParams(max_tokens=200,
                                                                    ignore_eos=True)))
    first = next(stream)
    assert first.request_id == "long"
    stub.Abort(pb.AbortRequest(request_id="long"))
    assert [r.finish_reason for r in stream][-1] == "abort"
    with pytest.raises(grpc.RpcError) as info:
        stub.Abort(pb.AbortRequest(request_id="long"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_and_model_info(stub):
    assert stub.Health(pb.HealthRequest()).healthy
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert info.max_model_len == 256 and info.has_tokenizer and info.vocab_size > 0


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6])), "prompt"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1.0)), "temperature"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=10_000)), "context"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
])
def test_bad_input_is_invalid_argument(stub, request_, field):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def _without_tool_versions(text: str) -> str:
    """The stubs name the grpcio-tools/protobuf release that wrote them; a newer patch
    release of the tools writes the same code with another number, which is not staleness."""
    import re
    text = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = ''", text)
    text = re.sub(r"# Protobuf Python Version: .*", "# Protobuf Python Version:", text)
    return re.sub(r"(Domain\.PUBLIC,\s*)\d+,\s*\d+,\s*\d+,", r"\1", text)


def test_proto_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    from tllm.serve.grpc.generate import generate
    assert generate(tmp_path) == 0
    from pathlib import Path
    here = Path(__file__).resolve().parents[3] / "tllm/serve/grpc"
    for name in ("tllm_pb2.py", "tllm_pb2_grpc.py"):
        fresh = (tmp_path / "tllm/serve/grpc" / name).read_text()
        assert _without_tool_versions(fresh) == _without_tool_versions((here / name).read_text())


def test_with_the_api_key_every_call_but_health_needs_it():
    """Issue 31, item 6: --api-key covers the gRPC port too (Health stays open, a probe)."""
    with HttpAndGrpc(FakeLLM(), ServerConfig(model="fake", api_key="k")) as both:
        with grpc.insecure_channel(f"127.0.0.1:{both.grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            assert stub.Health(pb.HealthRequest()).healthy
            calls = [lambda **kw: stub.ModelInfo(pb.ModelInfoRequest(), **kw),
                     lambda **kw: list(stub.Generate(pb.GenerateRequest(text="hi"), **kw)),
                     lambda **kw: stub.Abort(pb.AbortRequest(request_id="x"), **kw),
                     lambda **kw: stub.Embed(pb.EmbedRequest(), **kw)]
            for call in calls:
                for metadata in (None, [("authorization", "Bearer nope")]):
                    with pytest.raises(grpc.RpcError) as error:
                        call(metadata=metadata)
                    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = [("authorization", "Bearer k")]
            assert calls[0](metadata=good).model == "fake"
            with pytest.raises(grpc.RpcError) as error:
                calls[2](metadata=good)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as error:     # past the key: the task's refusal
                calls[3](metadata=good)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_embed_equals_the_http_embeddings_and_names_bad_input():
    from tllm.serve.testing_pooling import FakePoolingLLM, fake_embedding
    with HttpAndGrpc(FakePoolingLLM(task="embed"), ServerConfig(model="embedder")) as both:
        with grpc.insecure_channel(f"127.0.0.1:{both.grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            answer = stub.Embed(pb.EmbedRequest(inputs=[
                pb.EmbedInput(text="hi"), pb.EmbedInput(text="there")], dimensions=4))
            http = httpx.post(both.http_url + "/v1/embeddings",
                              json={"input": ["hi", "there"], "dimensions": 4}).json()
            by_ids = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(
                token_ids=pb.TokenIds(ids=[104, 105]))]))
            bad = [pb.EmbedRequest(), pb.EmbedRequest(inputs=[pb.EmbedInput()]),
                   pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], dimensions=99),
                   pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=[999]))])]
            codes = []
            for request_ in bad:
                with pytest.raises(grpc.RpcError) as error:
                    stub.Embed(request_)
                codes.append(error.value.code())
    assert len(answer.embeddings) == 2
    for embedding, data in zip(answer.embeddings, http["data"]):    # float32 on the wire
        assert list(embedding.values) == pytest.approx(data["embedding"], abs=1e-6)
    assert answer.prompt_tokens == http["usage"]["prompt_tokens"] == 7
    assert list(by_ids.embeddings[0].values) == pytest.approx(fake_embedding([104, 105], 8))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * len(bad)


def test_embed_of_a_generation_model_names_the_task():
    with HttpAndGrpc(FakeLLM(), ServerConfig(model="fake")) as both:
        with grpc.insecure_channel(f"127.0.0.1:{both.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.GenerationStub(channel).Embed(pb.EmbedRequest(
                    inputs=[pb.EmbedInput(text="a")]))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embed" in error.value.details()
