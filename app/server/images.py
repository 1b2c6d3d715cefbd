"""Image sources as API requests give them, resolved for the engine: data URLs pass through (the library decodes
them), http(s) URLs are fetched (with a timeout and a size limit, unless the server was told not to), and local
files are read only under the directory the user allowed. Everything else is the client's 400.

Runs in the worker thread that renders the prompt (chat/pipeline.py `prepare`), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from mlxpaged.errors import ImageInputError
from mlxpaged.vision.images import MAX_IMAGES, MAX_PIXELS, ImageLimits

import httpx

URL_TIMEOUT_S = 10.0
MAX_URL_BYTES = 20 * 2**20


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be: fetched URLs (`fetch_urls`, within `url_timeout_s` and `max_url_bytes`),
    local files under `image_dir` (None: none), and at most `max_images` of at most `max_pixels` each."""

    fetch_urls: bool = True
    url_timeout_s: float = URL_TIMEOUT_S
    max_url_bytes: int = MAX_URL_BYTES
    image_dir: Path | None = None
    max_images: int = MAX_IMAGES
    max_pixels: int = MAX_PIXELS

    @property
    def limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_pixels)


def resolve_images(messages: list[dict], policy: ImagePolicy) -> list[dict]:
    """`messages` with every image part's source a data URL, bytes or an allowed local path."""
    out = []
    index = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                part = {**part, "image": resolve_source(part["image"], index, policy)}
                index += 1
            parts.append(part)
        out.append({**message, "content": parts})
    return out


def resolve_source(source: object, index: int, policy: ImagePolicy) -> object:
    """One image's source as the library takes it (see the module)."""
    if not isinstance(source, str):
        return source  # bytes a converter decoded already (Anthropic's and Ollama's base64)
    which = f"image {index + 1}"
    if source.startswith("data:"):
        return source
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        if not policy.fetch_urls:
            raise ImageInputError(
                f"{which}: this server does not fetch image URLs (started with --no-image-urls); send the image "
                "as a data URL",
                param="images",
            )
        return fetch(source, which, policy)
    if scheme in ("file", ""):
        return local_file(unquote(urlparse(source).path) if scheme == "file" else source, which, policy)
    raise ImageInputError(
        f"{which}: {source[:60]!r} is neither a data URL, an http(s) URL nor a local file", param="images"
    )


def fetch(url: str, which: str, policy: ImagePolicy) -> bytes:
    """The body of `url`, at most `max_url_bytes`, within `url_timeout_s`."""
    try:
        with (
            httpx.Client(timeout=policy.url_timeout_s, follow_redirects=True) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ImageInputError(f"{which}: fetching {url} answered HTTP {response.status_code}", param="images")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > policy.max_url_bytes:
                    raise ImageInputError(
                        f"{which}: {url} is larger than the limit of {policy.max_url_bytes:,} bytes", param="images"
                    )
            return bytes(body)
    except httpx.TimeoutException:
        raise ImageInputError(
            f"{which}: fetching {url} took longer than {policy.url_timeout_s:g} s", param="images"
        ) from None
    except httpx.HTTPError as exc:
        raise ImageInputError(f"{which}: fetching {url} failed ({type(exc).__name__}: {exc})", param="images") from None


def local_file(path: str, which: str, policy: ImagePolicy) -> Path:
    """A local image file, only under the allowed directory (symlinks resolved first)."""
    if policy.image_dir is None:
        raise ImageInputError(
            f"{which}: {path!r} is a local file, and this server reads none (start it with --image-dir DIR to allow "
            "files under DIR)",
            param="images",
        )
    allowed = policy.image_dir.resolve()
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(allowed):
        raise ImageInputError(f"{which}: {path!r} is outside the allowed image directory {allowed}", param="images")
    return resolved
