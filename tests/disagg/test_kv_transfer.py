"""KV transfer between engines in this process (tiny random Llama, token-id prompts): a
context-only request's blocks are held, fetched and freed; the generation side's output is
the aggregated engine's; failures fall back to computing the prompt; bad params are
ValueErrors naming the field. The engines share a secret: every fetch is authenticated."""
from __future__ import annotations

import time

import pytest

from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.config import DisaggConfig

KWARGS = dict(max_seq_len=256, kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=8))
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, temperature=0.0)


SECRET = "kv-transfer-test-secret"


@pytest.fixture(scope="module")
def engines(tiny_llama):
    path = str(tiny_llama[0])
    agg = LLM(path, **KWARGS)
    ctx = LLM(path, disaggregation=DisaggConfig(role="context", hold_timeout_s=1.0,
                                                secret=SECRET), **KWARGS)
    # a second configured source that never answers: asking it costs nothing
    gen = LLM(path, disaggregation=DisaggConfig(
        role="generation", max_staging_bytes=1, secret=SECRET,
        kv_sources=("127.0.0.1:1", ctx.disagg_info["kv_endpoint"])), **KWARGS)
    yield agg, ctx, gen
    for llm in (agg, ctx, gen):
        llm.shutdown()


def _context(ctx, prompt, export_id):
    return ctx.generate({"prompt_token_ids": prompt, "disaggregated_params": {
        "request_type": "context_only", "ctx_request_id": export_id}}, GREEDY, use_tqdm=False)


def _generation(gen, prompt, export_id, source_id):
    return gen.generate({"prompt_token_ids": prompt, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": export_id,
        "opaque_state": source_id}}, GREEDY, use_tqdm=False)


def _wait_free(llm, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.get_stats()
        if stats["kv_blocks_free"] == stats["kv_blocks_total"] and not stats.get(
                "disagg_requests_held"):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


@pytest.mark.parametrize("length", [5, 8, 16, 37])    # within, at and across block edges
def test_generation_from_fetched_kv_equals_aggregated(engines, length):
    agg, ctx, gen = engines
    prompt = [(7 * i + 3) % 300 + 1 for i in range(length)]
    reference = agg.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False).outputs[0]
    context = _context(ctx, prompt, f"len{length}").outputs[0]
    assert len(context.token_ids) == 1 and context.token_ids[0] == reference.token_ids[0]
    ours = _generation(gen, prompt, f"len{length}", ctx.disagg_info["kv_source_id"]).outputs[0]
    assert ours.token_ids == reference.token_ids
    assert [lp[t].logprob for lp, t in zip(ours.logprobs, ours.token_ids)] == pytest.approx(
        [lp[t].logprob for lp, t in zip(reference.logprobs, reference.token_ids)], abs=1e-5)
    _wait_free(ctx), _wait_free(gen)
    assert gen.get_kv_cache_stats()["blocks_imported"] > 0


def test_context_only_request_publishes_its_prompt_blocks(engines):
    """A request that ends after its first step leaves its prompt's full blocks reusable."""
    _, ctx, _ = engines
    prompt = list(range(40, 80))
    _context(ctx, prompt, "publish-a")
    before = ctx.get_kv_cache_stats()["blocks_reused"]
    _context(ctx, prompt, "publish-b")
    assert ctx.get_kv_cache_stats()["blocks_reused"] - before == (len(prompt) - 1) // 8
    _wait_free(ctx)     # neither is fetched: both expire


def test_failed_fetch_computes_the_prompt_here(engines):
    agg, ctx, gen = engines
    prompt = list(range(100, 130))
    reference = agg.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False).outputs[0]
    failed = gen.get_stats()["disagg_num_failed"]
    ours = _generation(gen, prompt, "never-prefilled", ctx.disagg_info["kv_source_id"])
    assert ours.outputs[0].token_ids == reference.token_ids
    ours = _generation(gen, prompt, "x", "0" * 32)     # no configured source has this id
    assert ours.outputs[0].token_ids == reference.token_ids
    assert gen.get_stats()["disagg_num_failed"] == failed + 2
    _wait_free(gen)


def test_abort_while_fetching_frees_everything(engines):
    _, ctx, gen = engines
    prompt = list(range(1, 60))
    _context(ctx, prompt, "aborted")
    result = gen.generate_async({"prompt_token_ids": prompt, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": "aborted",
        "opaque_state": ctx.disagg_info["kv_source_id"]}},
        SamplingParams(max_tokens=200, ignore_eos=True))
    result.abort()
    assert result.result().outputs[0].finish_reason == "abort"
    _wait_free(ctx), _wait_free(gen)


@pytest.mark.parametrize("params, match", [
    ({"request_type": "both", "ctx_request_id": "a"}, "request_type"),
    ({"request_type": "context_only"}, "ctx_request_id"),
    ({"request_type": "generation_only", "ctx_request_id": "a"}, "opaque_state"),
    ({"request_type": "generation_only", "ctx_request_id": "a", "opaque_state": "abc"},
     "opaque_state.*kv_source_id"),
    ({"request_type": "generation_only", "ctx_request_id": "a" * 257,
      "opaque_state": "0" * 32}, "ctx_request_id"),
    ({"request_type": "context_only", "ctx_request_id": "a", "extra": 1}, "unknown"),
])
def test_bad_disaggregated_params(engines, params, match):
    _, ctx, gen = engines
    with pytest.raises(ValueError, match=f"disaggregated_params.*{match}"):
        (gen if params["request_type"] == "generation_only" else ctx).generate(
            {"prompt_token_ids": [1, 2], "disaggregated_params": params}, use_tqdm=False)


def test_roles_are_checked(engines):
    agg, ctx, gen = engines
    context_only = {"request_type": "context_only", "ctx_request_id": "a"}
    for llm in (agg, gen):
        with pytest.raises(ValueError, match="disaggregated_params"):
            llm.generate({"prompt_token_ids": [1, 2], "disaggregated_params": context_only},
                         use_tqdm=False)
    with pytest.raises(ValueError, match="n=1"):
        ctx.generate({"prompt_token_ids": [1, 2], "disaggregated_params": context_only},
                     SamplingParams(n=2), use_tqdm=False)


def test_kv_port_serves_only_what_passes_the_handshake(engines, tmp_path):
    """Strangers to the context server's KV port (no hello, no secret, a pickle, too many
    connections) are refused or closed, and it goes on serving its generation server."""
    import socket

    from tests.disagg.fake_kv_source import old_style_answer
    from tllm.disagg.handshake import client_handshake
    from tllm.disagg.messages import TcpFetchReply
    from tllm.disagg.wire import TransferError, recv_reply
    from tllm.config import parse_endpoint
    _, ctx, gen = engines
    address = parse_endpoint(ctx.disagg_info["kv_endpoint"])
    with socket.create_connection(address, timeout=5) as sock:   # the old protocol
        request = b'{"op": "fetch", "id": "x", "transport": "tcp"}'
        sock.sendall(len(request).to_bytes(4, "big") + request)
        with pytest.raises(TransferError, match="expected hello"):
            recv_reply(sock, TcpFetchReply)
        assert sock.recv(1) == b""      # closed
    with socket.create_connection(address, timeout=5) as sock:
        with pytest.raises(TransferError, match="expects a shared secret"):
            client_handshake(sock, None)
    with socket.create_connection(address, timeout=5) as sock:   # a pickle for a header
        sock.sendall(old_style_answer(tmp_path / "ran"))
        with pytest.raises(TransferError, match="refused: a malformed KV request"):
            recv_reply(sock, TcpFetchReply)
        assert sock.recv(1) == b""
    flood = [socket.create_connection(address, timeout=5) for _ in range(65)]
    try:
        assert flood[-1].recv(1) == b""     # over MAX_CONNECTIONS: closed unanswered
    finally:
        for sock in flood:
            sock.close()
    prompt = list(range(3, 20))
    _context(ctx, prompt, "after-strangers")
    fetched = ctx.get_stats()["disagg_num_fetched"]
    _generation(gen, prompt, "after-strangers", ctx.disagg_info["kv_source_id"])
    assert ctx.get_stats()["disagg_num_fetched"] == fetched + 1
    assert not (tmp_path / "ran").exists()
    _wait_free(ctx), _wait_free(gen)
