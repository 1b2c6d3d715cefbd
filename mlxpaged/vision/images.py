"""Images as requests give them: decoded, checked against the limits, and named by their content.

A request's image is a path, raw bytes (a file's, or a data URL's once its base64 is read), or a PIL image. It
is decoded fully here (a truncated file fails here, not in the vision tower), converted to RGB, and named by
the sha256 of its pixels, so the same picture sent as PNG or as a file path is the same image to the prefix cache.
The processor does its own resizing (the model's min / max pixels); these limits only bound what a request may
send at all.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpaged.config import DEFAULT_MAX_IMAGE_PIXELS
from mlxpaged.errors import ImageInputError

if TYPE_CHECKING:  # Pillow comes with the vision extra: imported where an image is decoded
    from PIL import Image

MAX_IMAGES = 16  # per request
MAX_PIXELS = DEFAULT_MAX_IMAGE_PIXELS  # per image, before the processor resizes it


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = MAX_IMAGES
    max_pixels: int = MAX_PIXELS


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    digest: str  # sha256 of the pixels (hex)


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:<type>;base64,<data>` URL; ImageInputError for anything else."""
    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageInputError("an image data URL must look like 'data:image/png;base64,<data>'", param="images")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"an image data URL's base64 is invalid ({exc})", param="images") from None


def decode_image(source: object, index: int = 0, limits: ImageLimits = DEFAULT_LIMITS) -> DecodedImage:
    """Image `index` of a request (a path, bytes, a data URL or a PIL image) decoded to RGB, with its digest."""
    from PIL import Image

    which = f"image {index + 1}"
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str) and source.startswith("data:"):
            source = decode_data_url(source)
        if isinstance(source, str | Path):
            try:
                source = Path(source).read_bytes()
            except OSError as exc:
                raise ImageInputError(
                    f"{which}: cannot read {str(source)!r} ({exc.strerror})", param="images"
                ) from None
        if not isinstance(source, bytes | bytearray):
            raise ImageInputError(
                f"{which}: expected a path, bytes or a PIL image, got {type(source).__name__}", param="images"
            )
        image = _open(bytes(source), which, limits)
    if image.width * image.height > limits.max_pixels:
        raise ImageInputError(
            f"{which} has {image.width}x{image.height} = {image.width * image.height:,} pixels, more than the "
            f"limit of {limits.max_pixels:,}",
            param="images",
        )
    rgb = image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}|".encode() + rgb.tobytes()).hexdigest()
    return DecodedImage(rgb, digest)


def _open(data: bytes, which: str, limits: ImageLimits) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # PIL's own bomb warning: the limit below says it with our numbers
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageInputError(
            f"{which}: {len(data):,} bytes that are not an image in a format this server reads "
            "(PNG, JPEG, WebP, GIF, BMP, TIFF, ...)",
            param="images",
        ) from None
    if image.width * image.height > limits.max_pixels:  # before decoding the pixels: a decompression bomb stops here
        raise ImageInputError(
            f"{which} has {image.width}x{image.height} = {image.width * image.height:,} pixels, more than the "
            f"limit of {limits.max_pixels:,}",
            param="images",
        )
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageInputError(
            f"{which}: the {image.format} data is damaged or truncated ({exc})", param="images"
        ) from None
    return image


def scaled_to(image: Image.Image, pixels: int | None) -> Image.Image:
    """`image` scaled down, keeping its aspect, to at most `pixels` (the largest image the vision tower's memory is
    planned for: platform/memory.py); as it is when it has no more, or `pixels` is None."""
    from PIL import Image

    if pixels is None or image.width * image.height <= pixels:
        return image
    factor = (pixels / (image.width * image.height)) ** 0.5
    size = (max(1, int(image.width * factor)), max(1, int(image.height * factor)))
    return image.resize(size, Image.Resampling.BICUBIC)


def check_count(count: int, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    if count > limits.max_images:
        raise ImageInputError(
            f"{count} images in one request, more than the limit of {limits.max_images}", param="images"
        )


# --- image parts of a conversation (Engine.chat's messages) ---------------------------------------------------------
IMAGE_PART_TYPES = ("image",)


def image_parts(messages: Sequence[dict]) -> list[object]:
    """Every image of the conversation, in order (what each image part holds)."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    ]


def has_images(messages: Sequence[dict]) -> bool:
    return bool(image_parts(messages))


def placeholders(message: dict) -> dict:
    """The message with its image parts as bare `{"type": "image"}` placeholders (a chat template's input)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [{"type": "image"} if p.get("type") in IMAGE_PART_TYPES else p for p in content if isinstance(p, dict)]
    return {**message, "content": parts}
