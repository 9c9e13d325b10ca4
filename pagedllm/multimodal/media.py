"""Images from what users and clients send: PIL images, data: URLs, http(s) URLs and local
files, each read within limits and refused with a reason (a MediaError, a ValueError: the
server answers 400 with its text).

- Decompression bombs: an image's pixel count is read from its header and checked against the
  limit (Pillow's MAX_IMAGE_PIXELS unless set) before any pixel is decoded.
- URLs are fetched with httpx, within a time limit for the whole fetch and a byte limit.
- Local paths are read only under the allowed directory (`--allowed-local-media-path`), after
  resolving links, so neither `..` nor a symlink leads out of it.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse


class MediaError(ValueError):
    """An image that cannot be used, and why."""


@dataclass
class MediaPolicy:
    allowed_local_dir: Path | None = None  # None: no local files
    timeout_s: float = 10.0  # a URL's whole fetch
    max_bytes: int = 20 * 2**20  # an encoded image's size (data URL, download, file)
    max_pixels: int | None = None  # None: Pillow's Image.MAX_IMAGE_PIXELS

    def pixel_limit(self) -> int:
        if self.max_pixels is not None:
            return self.max_pixels
        from PIL import Image

        return int(Image.MAX_IMAGE_PIXELS or 89_478_485)


def load_image(source, policy: MediaPolicy | None = None):
    """A decoded RGB-or-other PIL image from a PIL image, data: URL, http(s) URL or local path."""
    policy = policy or MediaPolicy()
    if not isinstance(source, str):
        if hasattr(source, "tobytes"):
            return source
        raise MediaError(f"an image must be a PIL image or a URL string, got {type(source).__name__}")
    if source.startswith("data:"):
        return decode_image(_data_url(source, policy), policy, "the data URL's image")
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, policy), policy, source)
    if scheme == "file":
        source = unquote(urlparse(source).path)
    elif scheme and len(scheme) > 1:
        raise MediaError(f"image URL scheme {scheme!r} is not supported; use data:, http(s):// or a local path")
    return decode_image(_local(source, policy), policy, source)


def decode_image(data: bytes, policy: MediaPolicy, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))  # reads the header only
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise MediaError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None
    except Image.DecompressionBombError as e:
        raise MediaError(f"{what} is too large: {e}") from None
    w, h = im.size
    limit = policy.pixel_limit()
    if w * h > limit:
        raise MediaError(
            f"{what} is {w}x{h} = {w * h} pixels, over the limit of {limit} pixels "
            "(a decompression bomb, or an image to scale down before sending)"
        )
    try:
        im.load()
    except Image.DecompressionBombError as e:
        raise MediaError(f"{what} is too large: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"{what} is corrupt or truncated ({type(e).__name__}: {e})") from None
    return im


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise MediaError("a data URL image must be base64: data:image/png;base64,...")
    if len(body) * 3 // 4 > policy.max_bytes:
        raise MediaError(f"the data URL's image is over {policy.max_bytes} bytes")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL's base64 is invalid ({e})") from None


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    deadline = time.monotonic() + policy.timeout_s
    chunks, size = [], 0
    try:
        with httpx.stream("GET", url, timeout=policy.timeout_s, follow_redirects=True) as r:
            if r.status_code != 200:
                raise MediaError(f"fetching image {url} answered HTTP {r.status_code}")
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise MediaError(f"image {url} is over {policy.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(f"fetching image {url} took over {policy.timeout_s:g} s")
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise MediaError(f"fetching image {url} timed out after {policy.timeout_s:g} s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching image {url} failed ({type(e).__name__}: {e})") from None
    return b"".join(chunks)


def _local(path: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_dir is None:
        raise MediaError(
            f"local image paths are not allowed ({path}); start with --allowed-local-media-path DIR "
            "(LLM(allowed_local_media_path=DIR)) to read images under DIR"
        )
    root = Path(policy.allowed_local_dir).resolve()
    p = Path(path).expanduser().resolve()
    if not p.is_relative_to(root):
        raise MediaError(f"image path {path} is outside the allowed media directory")
    if not p.is_file():
        raise MediaError(f"image path {path} is not a file")
    if p.stat().st_size > policy.max_bytes:
        raise MediaError(f"image {path} is over {policy.max_bytes} bytes")
    return p.read_bytes()
