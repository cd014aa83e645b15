"""gRPC Generate with images (encoded files beside a text prompt with placeholders) on the
tiny Qwen2.5-VL: the Python API's tokens; a corrupt image or too many are
INVALID_ARGUMENT naming them."""
from __future__ import annotations

import grpc
import pytest

from tests.multimodal.conftest import IMAGE, make_image
from tests.multimodal.test_qwen2_5_vl import NUM_NEW, chat_text, make_llm, params
from tests.multimodal.test_serve_images import png_bytes
from tests.serve.grpc.test_grpc import HttpAndGrpc
from tllm.serve.context import ServerConfig
from tllm.serve.grpc import tllm_pb2 as pb
from tllm.serve.grpc import tllm_pb2_grpc as pb_grpc

GREEDY = pb.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stub_and_llm(tiny_qwen_vl):
    llm = make_llm(tiny_qwen_vl[0], limit_mm_per_prompt={"image": 2})
    with HttpAndGrpc(llm, ServerConfig(model="tiny-vl")) as both:
        with grpc.insecure_channel(f"127.0.0.1:{both.grpc_port}") as channel:
            yield pb_grpc.GenerationStub(channel), llm
    llm.shutdown()


def test_generate_with_images_equals_python_api(stub_and_llm):
    stub, llm = stub_and_llm
    images = [make_image(28, 56, 21), make_image(42, 42, 22)]
    text = chat_text(IMAGE, " and ", IMAGE)
    responses = list(stub.Generate(pb.GenerateRequest(
        text=text, images=[png_bytes(i) for i in images], sampling=GREEDY)))
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params(),
                          use_tqdm=False)
    assert [t for r in responses for t in r.token_ids] == direct.outputs[0].token_ids


@pytest.mark.parametrize("images, message", [
    ([b"not an image"], "images[0]: not an image"),
    ([png_bytes(make_image(28, 28, 0))] * 3, "at most 2"),
])
def test_bad_images_are_invalid_argument(stub_and_llm, images, message):
    stub = stub_and_llm[0]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(text=chat_text(IMAGE), images=images,
                                              sampling=GREEDY)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
