"""Images in requests, checked at the boundary: a data URL (or, with --allow-remote-images, an
http(s) URL, fetched by api/image_fetch.py) becomes the processor's patches, or a 400 naming the
part, the cause and the server's limit.

Every API's image part (chat ``image_url``, Messages ``image``, Responses ``input_image``)
arrives here as an ``ImageRef``; decoding (PNG, JPEG, WebP, GIF's first frame) and the
processor's resize run off the event loop.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from dflash_server.api.errors import APIError
from dflash_server.api.image_fetch import (
    FetchFailed,
    FetchRefused,
    FetchTooLarge,
    HostPolicy,
    fetch_image,
)
from dflash_server.models.vision import ImageInput, ImageTooLarge, VisionTower, open_image
from dflash_server.settings import Settings

FETCH_SECONDS = 10.0  # a remote image must arrive within this
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image, encoded
MAX_DECODED_PIXELS = 64 * 1024 * 1024  # one image before resizing (guards decompression bombs)
LOW_DETAIL_PIXELS = 512 * 512  # "detail": "low"
DETAILS = ("auto", "low", "high")
VIDEO_PARTS = ("video_url", "video", "input_video")
PART_KEY = "dflash_part"  # a translated image part names the request part it came from


@dataclass(frozen=True)
class ImageRef:
    """An image part of a request: its URL and ``detail``; ``part`` is its path in the request
    (named in messages), ``param`` the content field that holds it (the error's param)."""

    url: str
    part: str
    detail: str | None = None

    @property
    def param(self) -> str:
        return self.part.rpartition(".")[0] or self.part


def image_ref(part: dict[str, Any], where: str) -> ImageRef:
    """The image of a chat ``image_url`` part at ``where`` (its ``image_url`` an object with
    ``url`` and ``detail``, or a bare URL string as some clients send)."""
    where = part[PART_KEY] if isinstance(part.get(PART_KEY), str) else where
    value = part.get("image_url")
    if isinstance(value, str):
        value = {"url": value}
    url = value.get("url") if isinstance(value, dict) else None
    detail = value.get("detail") if isinstance(value, dict) else None
    ref = ImageRef(url if isinstance(url, str) else "", where, detail)
    if not ref.url:
        raise APIError(400, f"{where}: the image needs a URL (image_url.url)", param=ref.param)
    if detail is not None and detail not in DETAILS:
        raise APIError(
            400,
            f"{where}: image_url.detail must be one of {', '.join(DETAILS)}",
            param=ref.param,
            code="invalid_value",
        )
    return ref


def video_unsupported(where: str) -> APIError:
    return APIError(
        400,
        f"{where}: video input is not supported yet; send frames as images",
        param=where.rpartition(".")[0] or where,
        code="unsupported_content",
    )


async def load_images(
    refs: list[ImageRef], settings: Settings, vision: VisionTower | None, why_not: str
) -> list[ImageInput]:
    """The request's images as patches, in order; ``why_not`` says why a model without a
    vision tower takes none."""
    if not refs:
        return []
    if vision is None:
        raise APIError(
            400,
            f"{refs[0].part}: this model takes no images: {why_not}",
            param=refs[0].param,
            code="unsupported_content",
        )
    if len(refs) > settings.max_images:
        raise APIError(
            400,
            f"the request holds {len(refs)} images, more than the {settings.max_images} this "
            "server takes (--max-images)",
            param=refs[settings.max_images].param,
            code="too_many_images",
        )
    return [await run_in_threadpool(_load, ref, settings, vision) for ref in refs]


def _load(ref: ImageRef, settings: Settings, vision: VisionTower) -> ImageInput:
    data = _bytes(ref, settings)
    cap = settings.max_image_pixels
    if ref.detail == "low":
        cap = min(cap, LOW_DETAIL_PIXELS)
    try:
        return vision.prepare(open_image(data, MAX_DECODED_PIXELS), cap)
    except ImageTooLarge as exc:
        raise _too_many_pixels(ref, exc, settings) from None
    except ValueError as exc:
        raise APIError(400, f"{ref.part}: {exc}", param=ref.param, code="invalid_image") from exc


def _too_many_pixels(ref: ImageRef, exc: ImageTooLarge, settings: Settings) -> APIError:
    """The decoding limit as the server's own: the decoded cap, and the flag images are
    resized to anyway."""
    shape = f"{exc.size[0]}x{exc.size[1]} ({exc.pixels:,} pixels)" if exc.size else ""
    found = shape or (f"{exc.pixels:,} pixels" if exc.pixels else "")
    return APIError(
        400,
        f"{ref.part}: the image is {f'{found}, more' if found else 'larger'} than the "
        f"{exc.limit:,} pixels this server decodes; scale it down (images are resized to "
        f"--max-image-pixels, {settings.max_image_pixels:,} pixels, before the model sees them)",
        param=ref.param,
        code="image_too_large",
    )


def _bytes(ref: ImageRef, settings: Settings) -> bytes:
    """The encoded image of a data URL (base64), or fetched from an http(s) URL."""
    url, where, param = ref.url, ref.part, ref.param
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media = head[5:].split(";")[0]
        if media.startswith("video/"):
            raise video_unsupported(where)
        if not head.endswith(";base64") or (media and not media.startswith("image/")):
            raise APIError(
                400,
                f"{where}: a data URL must hold a base64 image (data:image/png;base64,...)",
                param=param,
                code="invalid_image",
            )
        try:
            raw = base64.b64decode("".join(data.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise APIError(
                400, f"{where}: the base64 data does not decode: {exc}", param=param,
                code="invalid_image",
            ) from exc  # fmt: skip
        if len(raw) > MAX_IMAGE_BYTES:
            raise _too_large(ref)
        return raw
    if not url[:8].lower().startswith(("http://", "https://")):
        scheme = url.partition(":")[0][:20] if ":" in url else ""
        raise APIError(
            400,
            f"{where}: {f'a {scheme} URL is not an image source here; ' if scheme else ''}"
            "an image must be a data URL (data:image/png;base64,...) or an http(s) URL",
            param=param,
            code="invalid_image",
        )
    if not settings.allow_remote_images:
        raise APIError(
            400,
            f"{where}: this server does not fetch image URLs; send the image as a data URL "
            "(data:image/png;base64,...), or start the server with --allow-remote-images",
            param=param,
            code="remote_images_disabled",
        )
    return _fetch(ref, settings)


def _fetch(ref: ImageRef, settings: Settings) -> bytes:
    """An http(s) image whose every hop is checked (api/image_fetch.py), within
    ``FETCH_SECONDS`` in all and ``MAX_IMAGE_BYTES``."""
    policy = HostPolicy.of(settings.allowed_image_hosts)
    try:
        return fetch_image(ref.url, policy, MAX_IMAGE_BYTES, FETCH_SECONDS)
    except FetchRefused as exc:
        raise APIError(
            400, f"{ref.part}: {exc}", param=ref.param, code="image_url_refused"
        ) from exc
    except FetchTooLarge:
        raise _too_large(ref) from None
    except FetchFailed as exc:
        raise APIError(
            400, f"{ref.part}: could not fetch the image: {exc}", param=ref.param,
            code="invalid_image",
        ) from exc  # fmt: skip


def _too_large(ref: ImageRef) -> APIError:
    return APIError(
        400,
        f"{ref.part}: the image is larger than {MAX_IMAGE_BYTES:,} bytes, the most this server "
        "takes for one image",
        param=ref.param,
        code="invalid_image",
    )
