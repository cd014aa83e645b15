"""The scheduler with drafts: 1 + k tokens for a drafting request, drafts shortened to the
budget, and a rollback that gives the blocks past the kept tokens back (or to the request's
reservation)."""
from __future__ import annotations

import pytest

from tests.scheduler.test_progress import make_request, make_scheduler


def decode_ready(scheduler, num_prompt=6, max_new=16):
    request = make_request("r1", num_prompt, max_new)
    scheduler.add_request(request)
    batch = scheduler.schedule()
    scheduler.kv_cache.prepare(batch)
    scheduler.advance(batch)
    request.append_token(7)
    return request


@pytest.mark.parametrize("reserve", [True, False])
def test_drafts_scheduled_then_rolled_back_with_their_blocks(reserve):
    scheduler = make_scheduler(num_blocks=16, reserve=reserve)
    kv = scheduler.kv_cache
    request = decode_ready(scheduler)              # 7 tokens, 6 computed, 2 blocks
    free_before = kv.num_free_blocks
    request.draft_token_ids = [1, 2, 3, 4, 5, 6]   # positions 7..12: into a 4th block
    batch = scheduler.schedule()
    assert batch.num_scheduled_tokens == [7]
    kv.prepare(batch)
    scheduler.advance(batch)
    kv.update(batch)
    assert len(kv.block_ids(request)) == 4 and request.num_computed_tokens == 13
    scheduler.rollback(request, 5)                 # one draft accepted
    assert request.num_computed_tokens == 8
    assert len(kv.block_ids(request)) == 2
    assert kv.num_free_blocks == free_before
    scheduler.finish(request)
    kv.free(request)
    assert kv.num_free_blocks == kv.num_blocks and kv._num_reserved == 0


def test_drafts_are_shortened_to_the_token_budget():
    scheduler = make_scheduler(max_num_tokens=3)
    request = decode_ready(scheduler, num_prompt=3)
    request.draft_token_ids = [1, 2, 3, 4]
    batch = scheduler.schedule()
    assert batch.num_scheduled_tokens == [3] and request.draft_token_ids == [1, 2]
