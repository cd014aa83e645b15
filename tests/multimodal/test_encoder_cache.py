"""The encoder cache: each hash encoded once, the missing items of a call encoded together,
least recently used dropped past its size; the image hashes of a block go into its
prefix-cache hash."""
from __future__ import annotations

import torch

from tllm.kv_cache.prefix import chain_hash
from tllm.multimodal.inputs import MultimodalInputs, MultimodalItem
from tllm.request import Request
from tllm.runner.multimodal import EncoderCache
from tllm.sampling_params import SamplingParams


def item(content_hash: str, length: int = 2, offset: int = 0) -> MultimodalItem:
    return MultimodalItem("image", content_hash, offset, length, {})


def test_each_hash_encoded_once_and_lru_dropped():
    calls = []

    def encode(items):
        calls.append([i.content_hash for i in items])
        return [torch.full((i.length, 3), float(ord(i.content_hash))) for i in items]

    cache = EncoderCache(encode, max_tokens=4)
    a, b, c = cache.get([item("a"), item("b"), item("a")])
    assert calls == [["a", "b"]] and torch.equal(a, c) and a[0, 0] == ord("a")
    cache.get([item("a")])                     # a is now the most recent
    cache.get([item("c")])                     # 6 rows > 4: b goes
    cache.get([item("a"), item("b")])
    assert calls == [["a", "b"], ["c"], ["b"]]
    assert cache.num_encoded == 4 and cache.num_hits == 3


def test_block_hash_includes_the_images_it_covers():
    def request(image: str) -> Request:
        r = Request("r", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), max_new_tokens=1)
        r.multimodal = MultimodalInputs([item(image, length=2, offset=5)])
        return r
    first, same, other = request("x"), request("x"), request("y")
    assert chain_hash(first, None, 0, 4) == chain_hash(other, None, 0, 4)  # before the image
    assert chain_hash(first, None, 1, 4) == chain_hash(same, None, 1, 4)
    assert chain_hash(first, None, 1, 4) != chain_hash(other, None, 1, 4)
