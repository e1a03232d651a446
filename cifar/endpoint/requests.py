"""What a request holds, read within limits: photos (a raw PNG or JPEG body, or multipart with several files)
or today's JSON tensor contract (cifar.serving_contract). Every problem is one BadRequest line (HTTP 400);
nothing a client sends reaches the model unchecked or produces a 500.

Photos are decoded and resized by cifar.data.additions.decode_image, as ingestion and batch prediction
read them: PNG or JPEG, RGB (or lossless to RGB), the size judged from the header before decoding, any
other size than 32x32 resized with the endpoint's `resize` filter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import anyio.to_thread
import numpy as np
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from cifar.data.additions import decode_image
from cifar.endpoint.settings import ServeSettings
from cifar.serving_contract import CONTRACT, InputContractError, validate_images
from cifar.text import printable

PHOTO_TYPES = ("image/png", "image/jpeg")
# Small bodies (a 32x32 PNG is ~3 KB, decoded in ~50 us) are decoded on the event loop: a hop to a worker
# thread costs more than the decoding. Photos are decoded in a thread, so the loop keeps answering.
INLINE_DECODE_BYTES = 32 * 1024
JSON_TYPES = ("application/json",)


class BadRequest(ValueError):
    """A request the endpoint refuses (HTTP 400): the message is one line naming the problem."""


@dataclass(frozen=True)
class Images:
    images: np.ndarray  # uint8 (N, 32, 32, 3)
    names: list[str]  # One per image: a file's name, "body", or "image 3".


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes `limit` bytes (a declared Content-Length is checked first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body is {int(declared):,} bytes, over the limit of {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the body is over the limit of {limit:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def read_photos(request: Request, settings: ServeSettings) -> Images:
    """A raw image body (Content-Type image/png or image/jpeg) or multipart/form-data with image files."""
    kind = media_type(request)
    body = await read_body(request, settings.max_request_bytes)
    if kind in PHOTO_TYPES:
        blobs = [("body", body)]
    elif kind == "multipart/form-data":
        blobs = await _multipart_files(request, body, settings)
    else:
        shown = printable(kind) or "none"
        raise BadRequest(f"Content-Type {shown} is not a photo: send image/png, image/jpeg or multipart/form-data "
                         "with image files (JSON tensors go to /invocations)")  # fmt: skip
    if sum(len(blob) for _, blob in blobs) <= INLINE_DECODE_BYTES:
        return _decode_all(blobs, settings)
    return await anyio.to_thread.run_sync(_decode_all, blobs, settings)


async def _multipart_files(request: Request, body: bytes, settings: ServeSettings) -> list[tuple[str, bytes]]:
    async def replay() -> dict:  # The body, already read within the limit, handed to Starlette's parser.
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=settings.max_files, max_fields=16)
    except (MultiPartException, HTTPException) as error:  # Starlette turns its parser's error into a 400.
        message = str(getattr(error, "detail", None) or getattr(error, "message", error))
        if "Too many files" in message:
            message = f"too many files: at most {settings.max_files} photos per request"
        raise BadRequest(f"the multipart body cannot be read: {message}") from None
    except (AssertionError, ValueError) as error:  # No boundary, a malformed header.
        raise BadRequest(f"the multipart body cannot be read: {printable(str(error))[:200]}") from None
    blobs = []
    try:
        for field, value in form.multi_items():
            if not isinstance(value, UploadFile):
                raise BadRequest(f"multipart field {printable(field)[:80]!r} is not a file: send photos only")
            blobs.append((printable(value.filename or field)[:200], await value.read()))
    finally:
        await form.close()
    if not blobs:
        raise BadRequest("the multipart body holds no file")
    return blobs


def _decode_all(blobs: list[tuple[str, bytes]], settings: ServeSettings) -> Images:
    images = []
    for name, blob in blobs:
        if not blob:
            raise BadRequest(f"{name}: an empty file")
        image, problem = decode_image(blob, settings.resize, max_pixels=settings.max_pixels)
        if problem is not None:
            kind, detail = problem
            raise BadRequest(f"{name}: not a usable photo ({kind}: {printable(detail)[:300]})")
        images.append(image)
    return Images(np.stack(images), [name for name, _ in blobs])


async def read_tensor(request: Request, settings: ServeSettings) -> Images:
    """Today's contract: Content-Type application/json, {"inputs": uint8 images [batch, 32, 32, 3]}."""
    kind = media_type(request)
    if kind not in JSON_TYPES:
        raise BadRequest(f"Content-Type {printable(kind) or 'none'} is not application/json. {CONTRACT}")
    body = await read_body(request, settings.max_request_bytes)
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the body is not JSON: {printable(str(error))[:200]}") from None
    except RecursionError:  # Thousands of '[': what MLflow's scoring server answers 500 (mlflow#4897).
        raise BadRequest("the body is JSON nested deeper than Python can parse") from None
    if not isinstance(payload, dict) or set(payload) != {"inputs"}:
        keys = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise BadRequest(f'the body must be {{"inputs": ...}}, got {printable(str(keys))[:200]}. {CONTRACT}')
    inputs = payload["inputs"]
    if isinstance(inputs, list) and len(inputs) > settings.max_json_images:
        raise BadRequest(f"{len(inputs)} images, over the limit of {settings.max_json_images} per request")
    try:
        booleans = b"true" in body or b"false" in body  # JSON's only spelling of them; else no walk for them.
        images = await anyio.to_thread.run_sync(lambda: validate_images(inputs, may_hold_booleans=booleans))
    except InputContractError as error:
        raise BadRequest(error.message) from None
    except RecursionError:
        raise BadRequest("the inputs are nested deeper than Python can read") from None
    if len(images) == 0:
        raise BadRequest(f"no images. {CONTRACT}")
    if len(images) > settings.max_json_images:
        raise BadRequest(f"{len(images)} images, over the limit of {settings.max_json_images} per request")
    return Images(images, [f"image {index}" for index in range(len(images))])
