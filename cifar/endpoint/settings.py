"""What the endpoint serves and within which limits: one validated settings object, every knob with its unit.

Defaults are sized for 2 CPU cores (docs/BENCHMARKS.md "Serving" has the measurements behind them); each is
a command-line flag of `flows/serve.py` and an environment variable CIFAR_SERVE_<FIELD> (upper case; empty
means the default), e.g. those the compose `serve` service passes: CIFAR_SERVE_ALIAS, CIFAR_SERVE_POLL_SECONDS,
CIFAR_SERVE_MAX_BATCH, CIFAR_SERVE_MAX_WAIT_MS, CIFAR_SERVE_MAX_QUEUED_IMAGES, CIFAR_SERVE_MAX_REQUEST_BYTES and
CIFAR_SERVE_MAX_FILES.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cifar.data.additions import MAX_DECODED_PIXELS, RESIZE_METHODS

ENV_PREFIX = "CIFAR_SERVE_"


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tracking_uri: str = Field(description="The MLflow tracking server (or sqlite:/// store) holding the registry.")
    model_name: str = Field("cifar10", min_length=1, max_length=256)
    alias: str = Field("champion", min_length=1, max_length=256, description="The alias followed.")
    poll_seconds: float = Field(5.0, gt=0, le=3600, description="How often the alias is read (s).")
    # Batching: the first request waits at most `max_wait_ms` for company, a model call takes at most
    # `max_batch` images. On 2 cores the model's own speed grows up to ~64 images per call (BENCHMARKS).
    max_batch: int = Field(64, ge=1, le=4096, description="Images per model call at most.")
    max_wait_ms: float = Field(4.0, ge=0, le=1000, description="How long a lone request waits for others (ms).")
    # Beyond this many images waiting, a request is answered 503 with Retry-After: latency stays bounded
    # (at ~2,000 images/s, 512 queued images are a quarter of a second of work).
    max_queued_images: int = Field(512, ge=1, le=1_000_000)
    retry_after_seconds: int = Field(1, ge=1, le=3600, description="Retry-After of a 503 (s).")
    # What one request may hold.
    max_request_bytes: int = Field(20 << 20, ge=1024, le=1 << 30, description="A request body's bytes at most.")
    max_files: int = Field(64, ge=1, le=4096, description="Photos in one multipart request at most.")
    max_pixels: int = Field(MAX_DECODED_PIXELS, ge=32 * 32, le=MAX_DECODED_PIXELS, description="Per photo.")
    max_json_images: int = Field(256, ge=1, le=65536, description="Images in one JSON tensor request at most.")
    resize: str = Field("bilinear", description=f"How a photo other than 32x32 is resized: {RESIZE_METHODS}.")
    top_k: int = Field(3, ge=1, le=10, description="Classes in an answer unless the request asks (?top_k=).")
    cache_dir: str | None = Field(None, description="Where versions are downloaded (default: a temporary dir).")

    def model_post_init(self, context: Any) -> None:
        if self.resize not in RESIZE_METHODS:
            raise ValueError(f"resize: {self.resize!r} is not one of {RESIZE_METHODS}")

    @property
    def model_uri(self) -> str:
        return f"models:/{self.model_name}@{self.alias}"


def settings_from(values: dict[str, Any], environ: dict[str, str] | None = None) -> ServeSettings:
    """Settings from `values` (flags given), then CIFAR_SERVE_* variables, then the defaults; one ValueError
    naming the field for a bad value."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    for name in ServeSettings.model_fields:
        if values.get(name) is not None:
            merged[name] = values[name]
        elif environ.get(ENV_PREFIX + name.upper(), "").strip():  # Empty: the default (compose passes knobs so).
            merged[name] = environ[ENV_PREFIX + name.upper()].strip()
    try:
        return ServeSettings(**merged)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "settings"
        raise ValueError(f"serve {field}: {first['msg']}") from None
