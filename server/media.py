"""Images in requests (``--vision``): from the API's parts to the engine's ``MediaPrompt``.

Every API family turns its image parts (Chat ``image_url``, Responses ``input_image``, Anthropic
``image`` blocks) into template parts ``{"type": "image", "image": <data URI>, "param": <where
it was sent>}``; the chat template renders each as one image placeholder between the vision
tokens. ``images_of`` decodes and preprocesses them in prompt order (on the preparation worker
threads: never on the event loop or the engine thread); ``expand`` then gives each placeholder
the image's token count and the prompt its M-RoPE positions. A part that
is not a readable image is a 400 ``invalid_media`` naming it; http(s) URLs are fetched only with
``--allow-remote-media`` (a timeout and a size bound); without ``--vision`` any image is a
400 ``vision_disabled``. The images of the requests in flight are bounded together
(``MediaSettings.hold``, ``--media-live-mib``); decoding is bounded by the preparation threads.
"""
from __future__ import annotations

import base64
import binascii
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..engine.vision.media import MediaPrompt, expand_images
from ..engine.vision.processor import ImageProcessor, MediaError, ProcessedImage
from .errors import APIError, unsupported

REMOTE_TIMEOUT_S = 10.0  # an image fetched from a URL (--allow-remote-media) must arrive within this
REMOTE_MAX_BYTES = 32 << 20  # and be no larger than this
VISION_DISABLED = "image input needs the model's vision tower: this server runs without vision (start it with --vision)"
_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),(?P<data>.*)$", re.S)


@dataclass
class MediaSettings:
    processor: ImageProcessor
    image_token_id: int
    allow_remote: bool = False  # --allow-remote-media
    # --media-live-mib: the preprocessed images requests in flight may hold together; a request
    # that would go past it is a 429 ``media_overloaded`` (one alone always goes)
    live_bytes: int = 1 << 30
    held: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hold(self, media: MediaPrompt) -> int:
        """Count a request's images as live until ``release``; the bytes counted."""
        n = sum(im.image.nbytes for im in media.images)
        with self._lock:
            if self.held and self.held + n > self.live_bytes:
                raise APIError(429, f"requests in flight hold {self.held >> 20} MiB of images; this one's "
                               f"{n >> 20} MiB would pass the server's {self.live_bytes >> 20} MiB "
                               "(--media-live-mib); retry later", None, "media_overloaded")
            self.held += n
        return n

    def release(self, n: int) -> None:
        with self._lock:
            self.held -= n


def image_part(source: Any, param: str) -> dict[str, Any]:
    """The template part of an image sent at ``param`` (a data URI or URL)."""
    return {"type": "image", "image": source, "param": param}


def vision_disabled(param: str) -> APIError:
    return unsupported(param, VISION_DISABLED, "vision_disabled")


def invalid_media(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}' is not a usable image: {why}", param, "invalid_media")


def image_parts(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image parts of template messages, in the order a template renders them."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def source_bytes(source: Any, param: str, settings: MediaSettings) -> bytes:
    """The bytes of a data URI (base64 or percent-encoded); remote URLs are refused."""
    if not isinstance(source, str) or not source:
        raise invalid_media(param, "an image needs a data URI")
    if source.startswith(("http://", "https://")):
        if settings.allow_remote:
            return fetched(source, param)
        raise unsupported(param, "images from URLs are not fetched (start the server with --allow-remote-media); "
                          "send the image as a data URI", "remote_media_disabled")
    match = _DATA_URI.match(source)
    if match is None:
        raise invalid_media(param, "only data URIs (data:image/...;base64,...) are read")
    data = match.group("data")
    if ";base64" in (match.group("params") or ""):
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise invalid_media(param, "its base64 data does not decode") from None
    from urllib.parse import unquote_to_bytes

    return unquote_to_bytes(data)


def fetched(url: str, param: str) -> bytes:
    """The bytes at an http(s) URL, within ``REMOTE_TIMEOUT_S`` and ``REMOTE_MAX_BYTES`` (on a
    preparation thread); what cannot be had is a 400 ``invalid_media`` naming the part."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"User-Agent": "ninfer", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(request, timeout=REMOTE_TIMEOUT_S) as response:
            data = response.read(REMOTE_MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise invalid_media(param, f"fetching it answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise invalid_media(param, f"it could not be fetched ({getattr(exc, 'reason', exc)})") from None
    if len(data) > REMOTE_MAX_BYTES:
        raise invalid_media(param, f"it is larger than {REMOTE_MAX_BYTES >> 20} MiB")
    return data


def images_of(state, messages: list[dict[str, Any]]) -> list[ProcessedImage]:
    """Decode and preprocess every image part of ``messages`` (none: an empty list)."""
    parts = image_parts(messages)
    if not parts:
        return []
    settings: MediaSettings | None = state.media
    if settings is None:
        raise vision_disabled(parts[0].get("param") or "messages")
    out = []
    for part in parts:
        param = part.get("param") or "messages"
        data = source_bytes(part.get("image"), param, settings)
        try:
            out.append(settings.processor.process_bytes(data))
        except MediaError as exc:
            raise invalid_media(param, str(exc)) from None
    return out


def expand(state, ids: list[int], images: list[ProcessedImage],
           marks: tuple[int, ...] | None) -> tuple[list[int], MediaPrompt | None, tuple[int, ...] | None]:
    """The prompt with each image placeholder expanded to its tokens, its ``MediaPrompt``, and the
    checkpoint marks moved by the expansion before them."""
    if not images:
        return ids, None, marks
    token = state.media.image_token_id
    at = [i for i, t in enumerate(ids) if t == token]
    if len(at) != len(images):
        raise APIError(400, f"the chat template rendered {len(at)} image placeholders for {len(images)} images; "
                       "its image parts need a template that renders them", "messages", "invalid_prompt")
    full, media = expand_images(ids, images, token)
    if marks is not None:
        marks = tuple(m + sum(im.tokens - 1 for a, im in zip(at, images) if a < m) for m in marks)
    return full, media, marks


def image_tokens(images: list[ProcessedImage]) -> int:
    """The tokens images add to a prompt past their one placeholder each."""
    return sum(im.tokens - 1 for im in images)
