"""Scheduler.release(batch) lets go only of what that step holds, with several steps in
flight as the loop keeps them: pipeline stages (every request of a step held until its
tokens come back, steps over disjoint requests) and overlap (beams that sample held by the
step they sample in). A request still held by a younger in-flight step is never scheduled
after an older step's release, through chunked prefill, preemption and aborts."""
from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.sampling.beam import BeamGroup
from tllm.sampling_params import SamplingParams
from tllm.scheduler.scheduler import Scheduler


def _scheduler(num_blocks: int, max_num_tokens: int, num_micro_batches: int = 1,
               reserve: bool = False) -> Scheduler:
    kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=num_blocks,
                        tokens_per_block=4, dtype=torch.float32, device="cpu",
                        reserve_full_generation=reserve)
    return Scheduler(kv, max_batch_size=6, max_num_tokens=max_num_tokens,
                     enable_chunked_prefill=True, num_micro_batches=num_micro_batches)


def _request(index: int, num_prompt: int, max_new: int) -> Request:
    start = 1000 + 100 * index
    return Request(f"r{index}", list(range(start, start + num_prompt)), SamplingParams(),
                   max_new_tokens=max_new)


def _launch(scheduler: Scheduler, in_flight: deque, hold: bool):
    batch = scheduler.schedule()
    if batch.requests:
        scheduler.kv_cache.prepare(batch)
        scheduler.advance(batch, hold=hold)
        scheduler.kv_cache.update(batch)
        in_flight.append(batch)
    return batch


def _end(scheduler: Scheduler, request: Request) -> None:
    scheduler.finish(request)
    scheduler.kv_cache.free(request)


def _complete_oldest(scheduler: Scheduler, in_flight: deque, done: set) -> None:
    """As the loop does: release, then the step's tokens reach the host."""
    batch = in_flight.popleft()
    scheduler.release(batch)
    for request in batch.requests:
        if id(request) in done or request.num_computed_tokens < request.num_tokens:
            continue    # ended while in flight, or a prefill chunk: no token
        request.append_token(7)
        if request.num_output_tokens >= request.max_new_tokens:
            done.add(id(request))
            _end(scheduler, request)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipelined_release_never_frees_a_younger_steps_requests(seed, num_stages):
    rng = random.Random(seed)
    scheduler = _scheduler(num_blocks=8, max_num_tokens=6, num_micro_batches=num_stages)
    requests = [_request(i, rng.randint(3, 14), rng.randint(1, 6)) for i in range(14)]
    for request in requests:
        scheduler.add_request(request)
    in_flight: deque = deque()
    done: set[int] = set()
    for _ in range(400):
        if not scheduler.has_unfinished and not in_flight:
            break
        while len(in_flight) < num_stages:
            younger = {id(r) for b in in_flight for r in b.requests}
            batch = _launch(scheduler, in_flight, hold=True)
            if not batch.requests:
                break
            # a request of an in-flight step is never in another step
            assert not younger & {id(r) for r in batch.requests}
        if in_flight:
            _complete_oldest(scheduler, in_flight, done)
        if in_flight and rng.random() < 0.15:     # an abort while its step is in flight
            victim = rng.choice(in_flight[-1].requests)
            if id(victim) not in done:
                done.add(id(victim))
                _end(scheduler, victim)
    assert len(done) == len(requests) and not in_flight
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.num_preemptions > 0      # the small cache preempts (never a held one)


def test_overlap_keeps_a_sampling_beam_held_past_an_older_steps_release():
    scheduler = _scheduler(num_blocks=32, max_num_tokens=4, reserve=True)
    beams = [_request(0, 10, 4), _request(1, 10, 4)]
    BeamGroup(beams)
    for beam in beams:
        scheduler.add_request(beam)
    in_flight: deque = deque()
    first = _launch(scheduler, in_flight, hold=False)    # beam 0 catches up: 4 tokens
    second = _launch(scheduler, in_flight, hold=False)   # 4 more, still not sampling
    assert first.requests == second.requests == [beams[0]]
    scheduler.release(in_flight.popleft())
    third = _launch(scheduler, in_flight, hold=False)    # the last 2: beam 0 samples
    assert third.num_scheduled_tokens == [2]
    scheduler.release(in_flight.popleft())               # the second step's release
    beams[0].append_token(7)                             # even with its next token known,
    assert scheduler.schedule().requests == []           # the sampling step still holds it
    scheduler.release(in_flight.popleft())
    assert scheduler.schedule().requests == [beams[0]]
