"""Images as users give them, made PIL RGB images within limits: a PIL image, a numpy
array, a file path (the Python API), or an OpenAI `image_url` (data: URLs always;
file:// only under an allowed folder; http(s) only through a fetcher for an operator's
allow-list, tllm.multimodal.fetch).
Every refusal is a MediaError (a ValueError) naming the part it came from."""
from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlparse

# 4096 x 4096 (the server's --max-image-pixels default): the models resize to about a
# megapixel anyway; a 48 KB PNG can state 20,000 x 20,000 pixels (1.2 GB decoded).
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
MIN_IMAGE_SIDE = 2
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class MediaError(ValueError):
    """An image that cannot be used; `param` names the part of the input it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def load_image(value: Any, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """A PIL RGB image from a PIL image, an [H, W] or [H, W, 3|4] uint8 array, or a path."""
    import numpy as np
    from PIL import Image
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (2, 3) or (
                value.ndim == 3 and value.shape[2] not in (3, 4)):
            raise MediaError("an image array must be uint8 [H, W] or [H, W, 3 or 4], got "
                             f"{value.dtype} {list(value.shape)}", param)
        image = Image.fromarray(value)
    elif isinstance(value, (str, os.PathLike)):
        image = _open_file(Path(value), param, max_pixels)
    else:
        raise MediaError("an image must be a PIL image, a numpy array or a file path, got "
                         f"{type(value).__name__}", param)
    check_size(image.size, param, max_pixels)
    return image.convert("RGB")


def load_image_url(url: str, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                   allowed_local_path: str | None = None,
                   fetch: Callable[[str, str], bytes] | None = None):
    """The image an OpenAI image_url names: a base64 data: URL, a file:// URL under
    `allowed_local_path`, or an http(s) URL `fetch(url, param)` gets the bytes of."""
    if not isinstance(url, str):
        raise MediaError("image_url.url must be a string", param)
    if url.startswith("data:"):
        return load_image(decode_data_url(url, param, max_pixels), param, max_pixels)
    scheme = urlparse(url).scheme
    if scheme == "file":
        if allowed_local_path is None:
            raise MediaError("file:// image URLs are off (allowed_local_media_path / "
                             "--allowed-local-media-path turns them on for a folder)", param)
        return load_image(_local_file(url, allowed_local_path, param), param, max_pixels)
    if scheme in ("http", "https"):
        if fetch is None:
            raise MediaError("http(s) image URLs are not fetched (--allowed-media-domains "
                             "turns them on for listed hosts); send the image as a base64 "
                             "data: URL", param)
        return decode_image_bytes(fetch(url, param), param, max_pixels)
    raise MediaError(f"image URLs of scheme {scheme or '(none)'!r} are not fetched; send "
                     "the image as a base64 data: URL", param)


def decode_data_url(url: str, param: str, max_pixels: int):
    """The image a data:image/...;base64, URL holds, its header checked before decoding."""
    header, _, data = url.partition(",")
    if not header.endswith(";base64") or not header.startswith("data:image/"):
        raise MediaError("a data: URL must be data:image/<format>;base64,<data>", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's base64 data is corrupt", param) from None
    return _open_bytes(io.BytesIO(raw), param, max_pixels)


def decode_image_bytes(raw: bytes, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """The PIL RGB image an encoded file holds, its header checked before decoding."""
    return load_image(_open_bytes(io.BytesIO(raw), param, max_pixels), param, max_pixels)


def check_size(size: tuple[int, int], param: str, max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise MediaError(f"the image is {width} x {height} = {width * height:,} pixels; "
                         f"at most {max_pixels:,} are taken", param)
    if min(width, height) < MIN_IMAGE_SIDE:
        raise MediaError(f"the image is {width} x {height} pixels; each side needs at "
                         f"least {MIN_IMAGE_SIDE}", param)


def _open_file(path: Path, param: str, max_pixels: int):
    try:
        with open(path, "rb") as f:
            return _open_bytes(io.BytesIO(f.read()), param, max_pixels)
    except OSError as exc:
        raise MediaError(f"cannot read image file {str(path)!r}: {exc.strerror}", param) from None


def _open_bytes(data: io.BytesIO, param: str, max_pixels: int):
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(data, formats=_FORMATS)   # the header only
    except Image.DecompressionBombError:
        raise MediaError(f"the image has more than {max_pixels:,} pixels", param) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise MediaError("not an image (PNG, JPEG, WebP, GIF or BMP)", param) from None
    check_size(image.size, param, max_pixels)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise MediaError("the image data is truncated or corrupt", param) from None
    return image


def _local_file(url: str, allowed: str, param: str) -> Path:
    root = Path(allowed).expanduser().resolve()
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"file:// URLs may only name files under {str(root)!r}", param)
    return path
