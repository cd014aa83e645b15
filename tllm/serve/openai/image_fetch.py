"""The http(s) image URLs of a chat request, fetched before its images are decoded: on
worker threads, concurrently, never on the event loop or the tokenizer's one thread (a slow
host must not hold other requests up). Only with --allowed-media-domains set."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tllm.multimodal.chat import remote_image_urls
from tllm.multimodal.fetch import (DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_FETCH_BYTES,
                                   media_fetcher)
from tllm.multimodal.media import MediaError


async def prefetch_images(args: Any, messages: list[dict], param: str,
                          max_images: int | None) -> Callable[[str, str], bytes] | None:
    """A `fetch(url, where)` serving the bytes fetched here (None: fetching is off); a
    failed fetch raises its MediaError, naming the part."""
    fetcher = media_fetcher(getattr(args, "allowed_media_domains", None),
                            getattr(args, "media_fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S),
                            getattr(args, "max_media_fetch_bytes", DEFAULT_MAX_FETCH_BYTES))
    if fetcher is None:
        return None
    urls = remote_image_urls(messages, param, max_images)
    bodies = await asyncio.gather(*(asyncio.to_thread(fetcher.fetch, url, where)
                                    for where, url in urls.items()))
    fetched = dict(zip(urls, bodies))

    def fetch(url: str, where: str) -> bytes:
        if where not in fetched:   # a part prefetching did not take as a URL
            raise MediaError("the image URL was not fetched", where)
        return fetched[where]
    return fetch
