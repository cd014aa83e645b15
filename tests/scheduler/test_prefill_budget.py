"""The prefill token budget (decodes first and uncounted, at most N prefill tokens a step):
every step within it, decodes never skip a step while prefills wait, new prompts join in
whole chunks without starving, and under a saturating load the running batch stays as
full as under the default policy (the whole-step budget's does not: its decodes crowd
out admission)."""
from __future__ import annotations

import random
import statistics

import pytest

from tests.scheduler.test_policy import is_decoding, make_request, make_scheduler, run_step
from tllm.scheduler.policy import SchedulingPolicy


def prefill_capped(budget: int, whole_chunks: bool = True) -> SchedulingPolicy:
    return SchedulingPolicy(prefill_token_budget=budget, admit_whole_chunks=whole_chunks)


def test_decodes_are_not_counted_and_prefill_chunks_stay_within_the_budget():
    scheduler = make_scheduler(prefill_capped(16), max_batch_size=8, max_num_tokens=64)
    for i in range(4):
        scheduler.add_request(make_request(i, 3, max_new=20))
    # no decode to protect yet: the step spends max_num_tokens
    assert run_step(scheduler) == {f"r{i}": 3 for i in range(4)}
    scheduler.add_request(make_request(9, 40))
    for _ in range(2):
        assert run_step(scheduler) == {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r9": 16}
    assert run_step(scheduler) == {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r9": 8}


@pytest.mark.parametrize("whole_chunks", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_step_within_budget_and_decodes_never_skip(seed, whole_chunks):
    rng = random.Random(seed)
    budget, max_num_tokens = 24, 64
    scheduler = make_scheduler(prefill_capped(budget, whole_chunks), max_batch_size=6,
                               max_num_tokens=max_num_tokens)
    pending = [make_request(i, rng.choice([3, 9, 30, 70]), max_new=rng.randint(2, 12))
               for i in range(30)]
    num_steps, num_decodes = 0, 0
    while pending or scheduler.has_unfinished:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                scheduler.add_request(pending.pop(0))
        decoding = {r.request_id for r in scheduler.running if is_decoding(r)}
        prefilling = any(not is_decoding(r) for r in scheduler.running) or scheduler.waiting
        step = run_step(scheduler)
        num_prefill = sum(n for rid, n in step.items() if rid not in decoding)
        assert sum(step.values()) <= max_num_tokens
        assert num_prefill <= (budget if decoding else max_num_tokens)
        if prefilling:
            assert decoding <= set(step), "a decode skipped a step while prefills waited"
            num_decodes += len(decoding)
        num_steps += 1
        assert num_steps < 1000
    assert num_decodes > 50
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_new_prompts_wait_for_slots_enough_to_fill_a_chunk():
    """32 slots, a chunk is 4 prompts: with 2 slots free the prompts wait (pure decode
    steps), with 4 free they join together; one waiting prompt joins at once."""
    scheduler = make_scheduler(prefill_capped(16), max_batch_size=32, max_num_tokens=256,
                               num_blocks=512)
    short = {28: 2, 29: 2, 30: 4, 31: 4}  # max_new of the four that finish first
    for i in range(32):
        scheduler.add_request(make_request(i, 4, max_new=short.get(i, 30)))
    run_step(scheduler)                    # all 32 admitted (no decodes yet)
    for i in range(32, 40):
        scheduler.add_request(make_request(i, 4, max_new=30))
    run_step(scheduler)                    # r28 and r29 finish: 2 slots free
    for _ in range(2):
        step = run_step(scheduler)
        assert set(step) <= {f"r{i}" for i in range(32)} and len(scheduler.waiting) == 8
    step = run_step(scheduler)             # r30 and r31 finished too: 4 join
    assert {rid: n for rid, n in step.items() if n > 1} == {f"r{i}": 4 for i in range(32, 36)}

    alone = make_scheduler(prefill_capped(16), max_batch_size=16, max_num_tokens=256)
    alone.add_request(make_request(0, 4, max_new=30))
    run_step(alone)
    alone.add_request(make_request(1, 4))
    assert run_step(alone) == {"r0": 1, "r1": 4}


@pytest.mark.parametrize("max_batch_size", [1, 2, 3])
def test_whole_chunks_never_starve_a_small_batch(max_batch_size):
    scheduler = make_scheduler(prefill_capped(64), max_batch_size=max_batch_size,
                               max_num_tokens=64)
    for i in range(12):
        scheduler.add_request(make_request(i, 5, max_new=4))
    num_steps = 0
    while scheduler.has_unfinished:
        run_step(scheduler)
        num_steps += 1
        assert num_steps < 200
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def mean_running_batch(policy: SchedulingPolicy, max_batch_size=32, isl=16, osl=16,
                       num_requests=160) -> float:
    """All requests at once (a saturating load); the mean running-batch size per step."""
    blocks = max_batch_size * (isl + osl) // 4 + 16
    scheduler = make_scheduler(policy, max_batch_size=max_batch_size, max_num_tokens=512,
                               num_blocks=blocks)
    for i in range(num_requests):
        scheduler.add_request(make_request(i, isl, max_new=osl))
    sizes = []
    while scheduler.has_unfinished:
        sizes.append(len(run_step(scheduler)))
    return statistics.mean(sizes)


def test_saturated_running_batch_is_as_full_as_the_default():
    """The default fills 32 slots at once. A whole-step budget of 64 tokens settles near
    64 * osl / (isl + osl) = 32 requests only after a slow ramp, and a budget of 32 at 16;
    a prefill budget of 64 (4 prompts a step; 2 replace those that finish) stays full."""
    default = mean_running_batch(SchedulingPolicy())
    assert mean_running_batch(SchedulingPolicy(step_token_budget=32)) < 0.6 * default
    assert mean_running_batch(SchedulingPolicy(step_token_budget=64)) < 0.9 * default
    for whole_chunks in (True, False):
        assert mean_running_batch(prefill_capped(64, whole_chunks)) >= 0.9 * default


def test_one_budget_at_a_time():
    with pytest.raises(ValueError, match="set one of them"):
        SchedulingPolicy(step_token_budget=8, prefill_token_budget=8)
    with pytest.raises(ValueError, match="prefill_token_budget must be >= 1"):
        SchedulingPolicy(prefill_token_budget=0)
