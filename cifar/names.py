"""What a name or a location in the config may be: model names, names that become directories or registry
entries, and the URLs and paths a source or a tracking store may have. Plain Python, no pydantic."""

from __future__ import annotations

import re
import urllib.parse

MODEL_FAMILIES = ("tutorial", "resnet", "fast", "tiny")  # `resnet` is spelled resnet{6n+2}: resnet20, resnet56.
MAX_RESNET_DEPTH = 1202  # The deepest CIFAR ResNet of the ResNet paper (19.4 M parameters).

SOURCE_SCHEMES = frozenset({"", "file", "http", "https"})  # "" is a local path.
TRACKING_SCHEMES = frozenset({"http", "https", "sqlite", "postgresql", "mysql", "file", "databricks"})


def parse_model_name(name: str) -> tuple[str, int | None]:
    """(family, ResNet depth or None) of a model name; ValueError for a name no builder has."""
    match = re.fullmatch(r"resnet(\d+)", name)
    if match:
        depth = int(match.group(1)[:6])  # Six digits are already far past the bound.
        if depth < 8 or (depth - 2) % 6 or depth > MAX_RESNET_DEPTH:
            raise ValueError(
                f"ResNet depth must be 6n+2 between 8 and {MAX_RESNET_DEPTH} (20, 32, 44, 56, 110, ...), got {name!r}"
            )
        return "resnet", depth
    if name not in MODEL_FAMILIES or name == "resnet":
        raise ValueError(f"unknown model {name!r}: expected tutorial, fast, tiny or resnet{{6n+2}}")
    return name, None


def check_name(value: str) -> str:
    """A name that becomes a directory or a registry entry: no separators, no `..`, nothing to escape."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", value) or ".." in value:
        raise ValueError(
            f"must be 1-128 letters, digits, '.', '_' or '-', start with a letter or digit and hold no "
            f"'..', got {value!r}"
        )
    return value


def check_location(value: str, schemes: frozenset[str]) -> str:
    """A URL with one of `schemes`, or a local path (scheme ''), without control characters."""
    if not value.strip() or any(ord(character) < 32 for character in value):
        raise ValueError(f"must be a non-empty URL or path without control characters, got {value!r}")
    scheme = urllib.parse.urlsplit(value.strip()).scheme.lower()
    if scheme not in schemes and len(scheme) != 1:  # A one-letter scheme is a Windows drive letter.
        raise ValueError(f"scheme {scheme!r} is not allowed: expected one of {', '.join(sorted(schemes - {''}))}")
    return value
