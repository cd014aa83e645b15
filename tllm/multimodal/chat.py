"""Chat messages with OpenAI content parts: the image parts (`image_url`, or `image` with a
PIL image, array or path from the Python API) taken out as images, in order, each replaced
by the `{"type": "image"}` part chat templates render as the model's image placeholder."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from tllm.multimodal.media import (DEFAULT_MAX_IMAGE_PIXELS, MediaError, load_image,
                                   load_image_url)

IMAGE_PART_TYPES = ("image_url", "image", "input_image")


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
               for message in messages if isinstance(message.get("content"), list)
               for part in message["content"])


def split_chat_images(messages: list[dict[str, Any]], param: str = "messages",
                      max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                      allowed_local_path: str | None = None,
                      max_images: int | None = None,
                      fetch: Callable[[str, str], bytes] | None = None
                      ) -> tuple[list[dict], list]:
    """(messages with image placeholders, their PIL images); `fetch(url, where)` gets an
    http(s) URL's bytes (None: such URLs are refused). Refusals are MediaErrors naming the
    part, e.g. `messages.1.content.0`."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES):
                parts.append(part)
                continue
            where = f"{param}.{i}.content.{j}"
            if max_images is not None and len(images) >= max_images:
                raise MediaError(f"more than {max_images} images in one prompt "
                                 "(--limit-mm-per-prompt)", where)
            images.append(_part_image(part, where, max_pixels, allowed_local_path, fetch))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def remote_image_urls(messages: list[dict[str, Any]], param: str = "messages",
                      max_images: int | None = None) -> dict[str, str]:
    """{where: url} of the http(s) image URLs among the first `max_images` image parts
    (the server fetches these before the rest is decoded)."""
    urls, count = {}, 0
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not (isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES):
                continue
            count += 1
            if max_images is not None and count > max_images:
                return urls
            url = _part_url(part)
            if isinstance(url, str) and urlparse(url).scheme in ("http", "https"):
                urls[f"{param}.{i}.content.{j}"] = url
    return urls


def _part_image(part: dict, where: str, max_pixels: int, allowed_local_path: str | None,
                fetch: Callable[[str, str], bytes] | None):
    kind = part["type"]
    if kind == "image" and "image" in part:
        return load_image(part["image"], where, max_pixels)
    url = _part_url(part)
    if not isinstance(url, str):
        raise MediaError(f"an {kind} part needs its image's URL", where)
    return load_image_url(url, where, max_pixels, allowed_local_path, fetch)


def _part_url(part: dict) -> Any:
    url = part.get("image_url")
    if part["type"] == "image_url" and isinstance(url, dict):
        url = url.get("url")
    return url
