"""Sliding-window KV savings: window layers give back the blocks their window has passed.

Manager level: the groups a model's layers form, blocks freed as tokens are computed,
admission and reservation counts, prefix reuse, swap and recompute with windows, no leaks.
End to end: a tiny Mistral with a small window and a tiny Qwen2 mixing full and window layers
give HF's greedy tokens with the savings on, and more requests run at once in the same memory.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import TINY
from tests.models.hf_reference import assert_greedy_matches_hf, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.attention.testing import setup_triton_for_tests
from tllm.kv_cache.groups import first_live_block, plan_layout
from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.sampling_params import SamplingParams as Params
from tllm.scheduler.interface import ScheduledBatch

BLOCK = 4
WINDOW = 8
_ids = itertools.count()
# the Triton backend runs interpreted on the CPU, switched on before any kernel is imported
TRITON_DEVICE = setup_triton_for_tests()


# ---- layouts ----

def test_layouts_of_single_kind_and_mixed_models():
    dense = plan_layout(4)
    assert dense.num_groups == 1 and dense.windows == [None] and dense.layer_groups == ()
    assert dense.layer_slots == (0, 1, 2, 3) and dense.num_slots == 4
    mistral = plan_layout(3, (16, 16, 16))                  # every layer the same window
    assert mistral.windows == [16] and mistral.num_slots == 3 and mistral.layer_groups == ()
    gemma2 = plan_layout(4, (8, None, 8, None))             # alternating: one group each
    assert gemma2.windows == [None, 8] and gemma2.num_slots == 2
    assert gemma2.layer_groups == (1, 0, 1, 0) and gemma2.layer_slots == (0, 0, 1, 1)
    gemma3 = plan_layout(6, (8,) * 5 + (None,))             # 5 window layers to 1 global
    assert gemma3.windows == [None] + [8] * 5 and gemma3.num_slots == 1
    assert gemma3.layer_groups == (1, 2, 3, 4, 5, 0)


def test_pipeline_stages_form_the_same_groups():
    windows = (8, None, 8, None, 8, None)
    first, second = plan_layout(3, windows, 0), plan_layout(3, windows, 3)
    assert first.groups == second.groups and first.layer_groups == second.layer_groups
    # layer 3 (full) and 5 (full) share slots with layer 0 (window) and 2 (window)
    assert first.layer_slots == (0, 0, 1) and second.layer_slots == (0, 0, 1)
    assert first.num_slots == second.num_slots == 2


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="layer_windows"):
        plan_layout(2, (0, 0))
    with pytest.raises(ValueError, match="layer_windows"):
        plan_layout(3, (8, None))


# ---- the manager ----

def make_manager(windows=(WINDOW,), num_blocks=32, reserve=True, **kw) -> KVCacheManager:
    layout = plan_layout(len(windows), windows)
    return KVCacheManager(num_layers=len(windows), num_kv_heads=1, head_dim=2,
                          num_blocks=num_blocks, tokens_per_block=BLOCK, dtype=torch.float32,
                          device="cpu", reserve_full_generation=reserve, layout=layout, **kw)


def make_request(prompt, max_new=8) -> Request:
    return Request(f"w{next(_ids)}", list(prompt), Params(), max_new_tokens=max_new)


def admit(manager, request) -> bool:
    admission = manager.try_admit(request)
    if admission is not None:
        request.num_computed_tokens = admission.num_computed_tokens
    return admission is not None


def compute(manager, request, num_tokens, token=7):
    """One step of `num_tokens`; past the prompt the step's token is a sampled one."""
    if request.num_computed_tokens + num_tokens > request.num_tokens:
        request.append_token(token)
    batch = ScheduledBatch([request], [num_tokens])
    assert manager.try_grow(request, num_tokens)
    manager.prepare(batch)
    request.num_computed_tokens += num_tokens
    manager.update(batch)


def live(table, null):
    return [b for b in table if b != null]


def test_blocks_behind_the_window_return_to_the_pool():
    manager = make_manager()
    request = make_request(range(20))
    assert admit(manager, request)
    compute(manager, request, 20)                       # 5 blocks written
    table = manager.block_ids(request)
    # position 20 sees keys 13..20: blocks 0-2 (tokens 0..11) are behind the window
    assert table[:3] == [manager.null_block] * 3 and manager.null_block not in table[3:]
    assert manager.stats.blocks_freed_by_window == 3
    assert manager.num_free_blocks == manager.num_blocks - 2
    for _ in range(8):                                  # decoding keeps about a window
        compute(manager, request, 1)
        first = first_live_block(WINDOW, request.num_computed_tokens, BLOCK)
        assert len(live(table, manager.null_block)) == len(table) - first <= WINDOW // BLOCK + 1
    stats = manager.stats_dict()
    assert stats["group0_window"] == WINDOW
    assert stats["group0_blocks_used"] == len(live(table, manager.null_block)) == 2
    manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks and manager._num_reserved == 0


def test_null_block_is_zero_and_never_handed_out():
    manager = make_manager(num_blocks=4, reserve=False)
    assert manager.num_blocks == 3
    for k, v in manager.slot_caches:
        assert not k[manager.null_block].any() and not v[manager.null_block].any()
    requests = [make_request(range(i * 10, i * 10 + 4), max_new=1) for i in range(3)]
    assert all(admit(manager, r) for r in requests)
    for request in requests:
        compute(manager, request, 4)
    assert all(manager.null_block not in manager.block_ids(r) for r in requests)


def test_admission_counts_the_windows_bounded_need():
    # 40 + 8 tokens: 12 blocks of full attention; a window of 8 with steps of at most 8
    # tokens spans cdiv(8 + 7, 4) + 1 = 5
    request = make_request(range(40))
    window = make_manager(max_step_tokens=8)
    assert window.max_blocks(request) == 5
    hybrid = make_manager((None, WINDOW), max_step_tokens=8)
    assert hybrid.max_blocks(request) == 12 + 5
    unbounded = make_manager()                    # the whole prompt may come in one step
    assert unbounded.max_blocks(request) == 12
    small = make_manager((None, WINDOW), num_blocks=17, max_step_tokens=8)  # 16 usable
    assert not small.fits_ever(request)
    assert admit(make_manager((None, WINDOW), num_blocks=18, max_step_tokens=8), request)


def test_a_reservation_covers_the_whole_life_and_shrinks_after_the_prompt():
    manager = make_manager((None, WINDOW), num_blocks=40, max_step_tokens=8)
    request = make_request(range(30), max_new=10)          # 40 tokens: 10 blocks per group
    assert admit(manager, request)
    assert manager._num_reserved == 10 + 5
    while request.num_computed_tokens < 30:                # chunks of 8 always have room
        compute(manager, request, min(8, 30 - request.num_computed_tokens))
    # the prompt is done: decode steps of one token need at most cdiv(1 + 7, 4) + 1 = 3
    held = len(live(manager.group_block_ids(request)[1], manager.null_block))
    assert manager._num_reserved == (10 - 8) + max(0, 3 - held)
    while request.num_output_tokens < 10:
        compute(manager, request, 1)
    assert manager._num_reserved >= 0
    manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks and manager._num_reserved == 0


def test_more_requests_fit_in_the_same_blocks():
    def num_admitted(manager):
        count = 0
        while admit(manager, request := make_request(range(100 * count, 100 * count + 40))):
            count += 1
            while request.num_computed_tokens < 40:
                compute(manager, request, min(8, 40 - request.num_computed_tokens))
        return count
    # the same memory: 30 blocks of both layers, or 60 of one layer in two groups
    full = make_manager((None, None), num_blocks=30, max_step_tokens=8)
    hybrid = make_manager((None, WINDOW), num_blocks=60, max_step_tokens=8)
    assert full.num_groups == 1 and hybrid.num_groups == 2
    assert num_admitted(full) == 2                          # 12 blocks each
    # 12 + 5 to be admitted, 12 + 3 once the prompt is done: 59 blocks hold 3
    assert num_admitted(hybrid) == 3 and hybrid.stats.peak_requests == 3


def test_prefix_reuse_takes_full_blocks_and_the_window_of_the_end():
    manager = make_manager((None, WINDOW))
    first = make_request(range(30))
    assert admit(manager, first)
    compute(manager, first, 30)
    manager.free(first)                                     # its blocks stay cached
    second = make_request(list(range(30)) + [99, 98, 97])
    assert admit(manager, second)
    assert second.num_computed_tokens == 28                 # 7 whole blocks
    full, window = manager.group_block_ids(second)
    assert len(full) == len(window) == 7 and manager.null_block not in full
    # position 28 sees keys 21..28: window blocks 5 and 6; blocks 0-4 were freed long ago
    # and are not needed
    first_live = first_live_block(WINDOW, 28, BLOCK)
    assert window[:first_live] == [manager.null_block] * first_live
    assert manager.null_block not in window[first_live:]
    compute(manager, second, second.num_tokens - 28)
    manager.free(second)
    assert manager.num_free_blocks == manager.num_blocks


def test_a_prefix_hit_shrinks_to_window_blocks_still_cached():
    manager = make_manager((None, WINDOW), num_blocks=18, reserve=False)   # 17 usable
    first = make_request(range(28))
    assert admit(manager, first)
    compute(manager, first, 28)          # holds 7 full + 2 window blocks; 5 freed, cached
    # a filler takes the 3 never-used blocks and evicts window blocks 4, 3, 2 (the oldest)
    filler = make_request(range(500, 512))
    assert admit(manager, filler) and manager.try_grow(filler, 12)
    manager.prepare(ScheduledBatch([filler], [12]))
    manager.free(filler)
    second = make_request(list(range(16)) + [99])
    assert admit(manager, second)
    # the full group still holds blocks 0-3 of the prefix, but position 16 would need window
    # blocks 2 and 3: the longest prefix whose window is cached is 2 blocks
    assert second.num_computed_tokens == 8
    full, window = manager.group_block_ids(second)
    assert full == manager.group_block_ids(first)[0][:2]
    assert manager.null_block not in window and len(window) == 2
    for request in (first, second):
        manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks


def test_swap_keeps_the_window_tables_and_their_contents():
    manager = make_manager((None, WINDOW), num_blocks=30, reserve=False, host_cache_blocks=20)
    request = make_request(range(22))
    assert admit(manager, request)
    compute(manager, request, 22)
    for k, v in manager.slot_caches:  # numbers in every slot (torch.empty may hold NaN)
        k.normal_()
        v.normal_()
    before = [[None if b == manager.null_block else manager._read_block(b) for b in t]
              for t in manager.group_block_ids(request)]
    assert manager.swap_out(request)
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.try_admit(request).num_computed_tokens == 22
    after = manager.group_block_ids(request)
    for old, new in zip(before, after):
        assert [o is None for o in old] == [b == manager.null_block for b in new]
        for contents, block_id in zip(old, new):
            if contents is not None:
                assert torch.equal(manager._read_block(block_id), contents)
    manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks


def test_recompute_after_preemption_reuses_what_is_cached():
    manager = make_manager((None, WINDOW), reserve=False)
    request = make_request(range(26))
    assert admit(manager, request)
    compute(manager, request, 26)
    compute(manager, request, 1)
    manager.free(request)                       # preempted: recompute from the cache
    assert admit(manager, request)
    assert request.num_computed_tokens == 24    # the last (partial) block is recomputed
    manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks


def test_random_steps_leak_nothing():
    g = torch.Generator().manual_seed(0)
    manager = make_manager((None, WINDOW, WINDOW), num_blocks=48, reserve=False,
                           max_step_tokens=6)
    running: list[Request] = []
    for step in range(300):
        choice = int(torch.randint(0, 4, (), generator=g))
        if choice == 0 or not running:
            prompt = torch.randint(0, 3, (int(torch.randint(1, 30, (), generator=g)),),
                                   generator=g).tolist()        # few tokens: shared prefixes
            request = make_request(prompt, max_new=10)
            if admit(manager, request):
                running.append(request)
        elif choice == 1:
            manager.free(running.pop(int(torch.randint(0, len(running), (), generator=g))))
        else:
            request = running[int(torch.randint(0, len(running), (), generator=g))]
            num = max(1, min(6, request.num_tokens - request.num_computed_tokens))
            if request.num_output_tokens < request.max_new_tokens and manager.try_grow(
                    request, num):
                if request.num_computed_tokens + num > request.num_tokens:
                    request.append_token(1)
                batch = ScheduledBatch([request], [num])
                manager.prepare(batch)
                request.num_computed_tokens += num
                manager.update(batch)
        _check_references(manager, running)
    for request in running:
        manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks and manager._num_reserved == 0
    assert manager.stats.blocks_freed_by_window > 0


def _check_references(manager, running):
    held: dict[int, int] = {}
    for request in running:
        for g, table in enumerate(manager.group_block_ids(request)):
            first = first_live_block(manager.windows[g], request.num_computed_tokens, BLOCK)
            assert table[:first] == [manager.null_block] * first
            assert len(table) * BLOCK >= request.num_computed_tokens
            for b in live(table, manager.null_block):
                held[b] = held.get(b, 0) + 1
    for block in manager.pool.blocks:
        if block.block_id != manager.null_block:
            assert block.ref_count == held.get(block.block_id, 0)


# ---- end to end ----

def make_windowed_model(arch, path, **config):
    import transformers
    torch.manual_seed(0)
    hf_config = getattr(transformers, f"{arch}Config")(**{**TINY, **config},
                                                       architectures=[f"{arch}ForCausalLM"])
    model = getattr(transformers, f"{arch}ForCausalLM")(hf_config).eval()
    model.save_pretrained(path)
    return model


def run_parity(path, hf_model, savings=True, **kwargs):
    prompts = make_prompts(hf_model.config.vocab_size)    # up to 60 tokens: past the window
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5)
    kv = KvCacheConfig(tokens_per_block=BLOCK, max_tokens=2048,
                       enable_sliding_window_savings=savings)
    with LLM(str(path), max_num_tokens=24, max_batch_size=3, kv_cache_config=kv,
             **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    assert_greedy_matches_hf(hf_model, prompts, outputs)
    return stats


def test_mistral_window_matches_hf_with_savings(tmp_path):
    hf_model = make_windowed_model("Mistral", tmp_path, sliding_window=WINDOW)
    stats = run_parity(tmp_path, hf_model)
    assert stats["num_groups"] == 1 and stats["group0_window"] == WINDOW
    assert stats["blocks_freed_by_window"] > 0 and stats["blocks_reused"] > 0


def test_qwen2_mixed_full_and_window_layers_match_hf(tmp_path):
    # layer 0 full attention, layers 1 and 2 windowed: one full group, two window groups
    hf_model = make_windowed_model("Qwen2", tmp_path, sliding_window=WINDOW,
                                   use_sliding_window=True, max_window_layers=1,
                                   num_hidden_layers=3)
    assert hf_model.config.layer_types[0] == "full_attention"
    stats = run_parity(tmp_path, hf_model)
    assert stats["num_groups"] == 3 and stats["blocks_freed_by_window"] > 0
    assert [stats[f"group{g}_window"] for g in range(3)] == [0, WINDOW, WINDOW]


def max_concurrent(path, savings: bool) -> int:
    """The most requests the scheduler ran at once for 8 requests of 40 + 16 tokens."""
    kv = KvCacheConfig(tokens_per_block=BLOCK, max_tokens=160,
                       enable_sliding_window_savings=savings)
    with LLM(str(path), max_num_tokens=16, max_batch_size=16, kv_cache_config=kv) as llm:
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(3, 384, (40,), generator=g).tolist() for _ in range(8)]
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    return stats["peak_requests"]


def test_more_requests_run_at_once_in_the_same_memory(tmp_path):
    make_windowed_model("Mistral", tmp_path, sliding_window=WINDOW)
    without, with_savings = max_concurrent(tmp_path, False), max_concurrent(tmp_path, True)
    assert without == 2                   # 40 blocks, 14 per request (56 tokens)
    assert with_savings >= 2 * without


def test_triton_backend_reads_window_tables(tmp_path):
    # full and window groups through both Triton kernels: blocks behind the window are the
    # null block in the tables the kernels read
    pytest.importorskip("triton")
    make_windowed_model("Qwen2", tmp_path, sliding_window=WINDOW, use_sliding_window=True,
                        max_window_layers=1)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (21, 30, 6)]

    def greedy(backend):
        with LLM(str(tmp_path), attn_backend=backend, dtype="float32",
                 device=str(TRITON_DEVICE), max_num_tokens=16, max_batch_size=4,
                 max_seq_len=64, kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK,
                                                               max_tokens=512)) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
            assert llm.get_kv_cache_stats()["blocks_freed_by_window"] > 0
        return [list(o.outputs[0].token_ids) for o in outs]
    assert greedy("triton") == greedy("torch")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_parallel_ranks_keep_the_same_groups(tmp_path, tp, pp):
    # stage 0 holds layers 0 (full) and 1 (window), stage 1 layer 2 (window): every rank
    # forms the model's three groups and takes block tables from rank 0's cache
    make_windowed_model("Qwen2", tmp_path, sliding_window=WINDOW, use_sliding_window=True,
                        max_window_layers=1, num_hidden_layers=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (25, 40, 9, 31)]
    params = SamplingParams(max_tokens=8, temperature=0)

    def greedy(**parallel):
        kv = KvCacheConfig(tokens_per_block=BLOCK, max_tokens=1024)
        with LLM(str(tmp_path), max_num_tokens=16, kv_cache_config=kv, device="cpu",
                 **parallel) as llm:   # ranks over gloo, also on a machine with one GPU
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.get_kv_cache_stats()["num_groups"] == 3
        return [o.outputs[0].token_ids for o in outs]
    assert greedy(tensor_parallel_size=tp, pipeline_parallel_size=pp) == greedy()
