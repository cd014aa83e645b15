"""Images that clients send (the layered image model's `image`, a video's `input_reference`):
base64 PNG, JPEG or WebP, decoded only once the size its header states is within the
server's pixel limit (--max-image-pixels). A 48 KB PNG can state 20,000 x 20,000 pixels;
decoded, that is 1.2 GB."""
from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from tllm.serve.http.errors import bad_request

# 4096 x 4096: a 4K frame (8.3 MP) and most photos pass; 48 MB decoded as RGB. The models
# resize their input to at most about a megapixel anyway.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
_FORMATS = ("PNG", "JPEG", "WEBP")


def decode_image(data: str, param: str, max_pixels: int) -> Any:
    """The PIL image in `data` (base64); 400 naming `param` if it is not an image of these
    formats, or has more than `max_pixels` pixels (checked before decoding)."""
    from PIL import Image, UnidentifiedImageError
    not_an_image = bad_request(f"{param} must be a base64-encoded PNG or JPEG file",
                               param=param)
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)),
                           formats=_FORMATS)    # reads the header only
    except Image.DecompressionBombError as exc:   # PIL's own limit, past ours
        stated = re.search(r"\((\d+) pixels\)", str(exc))
        what = f"the image is {int(stated.group(1)):,} pixels" if stated else "too large"
        raise _too_large(param, what, max_pixels) from None
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError) as exc:
        raise not_an_image from exc
    width, height = image.size
    if width * height > max_pixels:
        raise _too_large(param, f"the image is {width} x {height} = {width * height:,} pixels",
                         max_pixels)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise not_an_image from exc     # truncated or corrupt data after a good header
    return image


def _too_large(param: str, what: str, max_pixels: int):
    return bad_request(f"{param}: {what}; this server takes images of at most "
                       f"{max_pixels:,} pixels (--max-image-pixels)", param=param,
                       code="image_too_large")
