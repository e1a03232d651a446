"""Hypothesis strategies for the fuzz suite (tests/test_fuzz_*.py): what a careless or hostile person hands a door.

Each strategy draws valid inputs among the broken and hostile ones, so a property can check both halves:
what is accepted is read correctly, everything else is refused in one line. The profiles (`ci` in make
test, `fuzz` in make fuzz) are registered in tests/conftest.py; `budget` scales a test's share of them.
"""

from __future__ import annotations

import io
import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from PIL import Image

from cifar.data.synthetic import CLASS_NAMES


def budget(weight: float) -> settings:
    """The loaded profile's examples scaled by `weight` (a test's cost relative to the others), as a decorator."""
    return settings(max_examples=max(1, round(settings.default.max_examples * weight)))


def one_line(message: str) -> bool:
    """What a person reads at the terminal: one non-empty line, no traceback."""
    return bool(message.strip()) and "\n" not in message and "Traceback" not in message


class Sample:
    """A generated file: shown in Hypothesis' reports by its description, not as kilobytes of bytes (replay a
    failure from the blob Hypothesis prints)."""

    data: bytes
    description: str

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description}, {len(self.data)} bytes)"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))


# Plain values, JSON, and the mutations of any byte string.

JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON_VALUES = st.recursive(
    JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)
NESTING_DEPTHS = st.integers(1, 40) | st.integers(900, 1100) | st.integers(50_000, 200_000)


def deeply_nested(depth: int, opening: str = "[", closing: str = "]") -> str:
    """A document nested `depth` levels deep: small on disk, a recursion bomb for a naive parser."""
    return opening * depth + closing * depth


@st.composite
def mutations(draw, data: bytes) -> bytes:
    """`data` with a few bytes flipped, inserted, deleted, or cut off at the end."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        if edit == "flip" and data:
            data[position] ^= draw(st.integers(1, 255))
        elif edit == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif edit == "delete":
            del data[position : position + draw(st.integers(1, 8))]
        else:
            del data[position:]
    return bytes(data)


# Names: of files, folders, archive members.

NAME_BYTES = 255  # The longest file name Linux file systems take.
PLAUSIBLE_NAMES = ["Cat", "cat ", "dragon", ".cat", "cat.png", "data_batch_1", "-", "~", " ", "a\nb", "cat\x7f"]


def _as_file_name(name: str) -> str:
    """`name` made a name a file can have: no '/' or NUL, not '.' or '..', at most NAME_BYTES bytes."""
    name = name.replace("/", "_").replace("\x00", "_")
    while len(os.fsencode(name)) > NAME_BYTES:
        name = name[:-1]
    return name if name not in ("", ".", "..") else f"{name}_"


file_names = st.one_of(
    st.sampled_from(CLASS_NAMES),
    st.sampled_from(PLAUSIBLE_NAMES),
    st.text(min_size=1, max_size=30),
    st.binary(min_size=1, max_size=20).map(os.fsdecode),  # Not UTF-8: arrives surrogate-escaped.
    st.integers(200, NAME_BYTES).map(lambda length: "n" * length),
).map(_as_file_name)


# Images: encoded by PIL in any format, mode and size; headers that lie; broken files.

FORMAT_MODES = {
    "PNG": ("RGB", "RGBA", "RGBA-opaque", "L", "LA", "P", "P-transparent", "1", "I;16"),
    "JPEG": ("RGB", "L", "CMYK"),
    "GIF": ("P", "L"),
    "BMP": ("RGB", "L", "P", "1"),
    "TIFF": ("RGB", "RGBA", "L", "CMYK", "I", "F"),
    "WEBP": ("RGB", "RGBA"),
    "PPM": ("RGB", "L"),
}
SIDES = st.just(32) | st.integers(1, 70)
HUGE_SIDES = st.integers(1, 100) | st.integers(1, 65_535) | st.sampled_from([8_000, 9_000, 20_000, 65_535])


@dataclass(frozen=True, repr=False)
class ImageFile(Sample):
    """A file's bytes; `pixels` (32, 32, 3) when it is a lossless 32x32 image a reader must return exactly."""

    data: bytes
    pixels: np.ndarray | None = None
    description: str = ""
    declared: tuple[int, int] | None = None  # (width, height) its header states, when that is a lie.


def encode(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


@st.composite
def encoded_images(draw, sides=SIDES) -> ImageFile:
    """An image PIL writes: any of its formats and modes, any size, random pixels."""
    image_format = draw(st.sampled_from(sorted(FORMAT_MODES)))
    mode = draw(st.sampled_from(FORMAT_MODES[image_format]))
    width, height = draw(sides), draw(sides)
    rgb = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image, options, lossless = Image.fromarray(rgb), {}, False
    if mode in ("RGB", "RGBA-opaque"):
        image, lossless = (image.convert("RGBA") if mode == "RGBA-opaque" else image), image_format == "PNG"
    elif mode == "RGBA":
        image = Image.fromarray(np.dstack([rgb, rgb[..., :1]]), "RGBA")  # Some pixels transparent.
    elif mode == "I;16":
        image = Image.fromarray(rgb[..., 0].astype(np.uint16) * 257)
    elif mode == "P-transparent":
        image = image.convert("P")
        options["transparency"] = 0
    else:
        image = image.convert(mode)
    if image_format == "JPEG":
        options["quality"] = draw(st.integers(1, 100))
    description = f"{image_format} {mode} {width}x{height}"
    lossless = lossless and (width, height) == (32, 32)
    return ImageFile(encode(image, image_format, **options), rgb if lossless else None, description)


def with_declared_dimensions(data: bytes, image_format: str, width: int, height: int) -> bytes:
    """A real 32x32 file's header rewritten to declare `width` x `height` (the pixel data left as it was)."""
    data = bytearray(data)
    if image_format == "PNG":  # Signature (8), IHDR length (4), b"IHDR", width, height, 5 bytes more, CRC.
        data[16:24] = struct.pack(">II", width, height)
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    else:  # JPEG: the SOF0 segment holds precision (1), height (2), width (2) after its length.
        start = data.index(b"\xff\xc0") + 5
        data[start : start + 4] = struct.pack(">HH", height, width)
    return bytes(data)


@st.composite
def lying_headers(draw) -> ImageFile:
    """A 32x32 PNG or JPEG whose header declares other dimensions: a few hundred bytes can declare gigapixels,
    so a reader must judge the size from the header, before it decodes (or allocates) anything."""
    image_format = draw(st.sampled_from(["PNG", "JPEG"]))
    width, height = draw(HUGE_SIDES), draw(HUGE_SIDES)
    real = encode(Image.fromarray(np.full((32, 32, 3), 90, np.uint8)), image_format)
    return ImageFile(
        with_declared_dimensions(real, image_format, width, height), None, f"{image_format} declaring {width}x{height}"
    )


image_files = st.one_of(
    encoded_images(),
    encoded_images(),
    lying_headers(),
    encoded_images().flatmap(lambda image: mutations(image.data)).map(lambda data: ImageFile(data, None, "mutated")),
    st.binary(max_size=200).map(lambda data: ImageFile(data, None, "random bytes")),
    st.text(max_size=40).map(lambda text: ImageFile(text.encode(), None, "text")),
)


# Folder trees: files of any kind under any names, links and special files among them.


@dataclass(frozen=True)
class TreeEntry:
    path: tuple[str, ...]  # Relative to the tree's root.
    kind: str  # file, link, fifo, directory
    content: ImageFile | None = None
    target: str = ""  # A link's target.


LINK_TARGETS = st.sampled_from(["/etc/passwd", "/", "..", "../..", "missing", ".", "cat", "cat/0.png", "/dev/zero"])


@st.composite
def tree_entries(draw) -> TreeEntry:
    depth = draw(st.sampled_from([2, 2, 2, 1, 3]))
    first = draw(st.sampled_from(CLASS_NAMES) | file_names)  # Mostly class folders.
    path = (first, *draw(st.lists(file_names, min_size=depth - 1, max_size=depth - 1)))
    kind = draw(st.sampled_from(["file"] * 8 + ["link", "fifo", "directory"]))
    if kind == "file":
        return TreeEntry(path, kind, draw(image_files))
    return TreeEntry(path, kind, target=draw(LINK_TARGETS) if kind == "link" else "")


image_trees = st.lists(tree_entries(), max_size=6, unique_by=lambda entry: entry.path)


def write_tree(root: Path, entries: list[TreeEntry]) -> None:
    """Creates the entries under `root` (itself created); one that clashes with an earlier one is left out."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        path = root.joinpath(*entry.path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if entry.kind == "file":
                path.write_bytes(entry.content.data)
            elif entry.kind == "link":
                path.symlink_to(entry.target)
            elif entry.kind == "fifo":
                os.mkfifo(path)
            else:
                path.mkdir()
        except OSError:  # A file where a folder should be, a name taken: the tree is what could be made.
            continue


def files_under(root: Path) -> set[str]:
    """Every entry under `root` that is not a directory (links and special files included), never following a
    link: what a reader must either read or name as left out."""
    found, pending = set(), [""]
    while pending:
        relative = pending.pop()
        for name in os.listdir(root / relative):
            child = f"{relative}/{name}" if relative else name
            if stat.S_ISDIR(os.lstat(root / child).st_mode):
                pending.append(child)
            else:
                found.add(child)
    return found


# REST request bodies for the serving contract.


@st.composite
def image_lists(draw) -> tuple[Any, np.ndarray | None]:
    """(the JSON value of "inputs", the uint8 images it must be read as, or None when it breaks the contract)."""
    count = draw(st.integers(1, 2))
    images = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (count, 32, 32, 3), np.uint8)
    value: Any = images.tolist()
    damage = draw(st.sampled_from([None, None, "value", "ragged", "shape", "axis"]))
    if damage is None:
        return value, images
    if damage == "value":
        index = [draw(st.integers(0, size - 1)) for size in images.shape]
        value[index[0]][index[1]][index[2]][index[3]] = draw(
            st.floats()
            | st.integers(256)
            | st.integers(max_value=-1)
            | st.text(max_size=3)
            | st.none()
            | st.booleans()
            | st.lists(st.integers(0, 255), max_size=2)
            | st.just(3.0)  # fmt: skip
        )
    elif damage == "ragged":
        value[-1][draw(st.integers(0, 31))].pop()
    elif damage == "shape":
        value = np.asarray(value)[..., : draw(st.integers(0, 2))].tolist()
    else:
        value = value[0]  # One image without the batch axis.
    return value, None


@st.composite
def request_bodies(draw) -> tuple[str, np.ndarray | None, bool]:
    """(a POST /invocations body, the images its "inputs" hold when they keep the contract, whether the body as a
    whole is a request the server must answer)."""
    inputs, images = draw(image_lists())
    kind = draw(st.sampled_from(["inputs"] * 4 + ["named", "other_key", "extra_key", "json", "text", "nested"]))
    if kind == "inputs":
        return json.dumps({"inputs": inputs}), images, images is not None
    if kind == "named":  # The model's one named input is "images"; any other name is refused.
        name = draw(st.sampled_from(["images", "pixels"]))
        return json.dumps({"inputs": {name: inputs}}), images, images is not None and name == "images"
    if kind == "other_key":
        key = draw(st.sampled_from(["instances", "dataframe_split", "dataframe_records", "data", ""]))
        return json.dumps({key: inputs}), None, False
    if kind == "extra_key":  # MLflow itself may take "params"; the images are judged all the same.
        extra = draw(st.sampled_from(["params", "x", "instances"]))
        return json.dumps({"inputs": inputs, extra: draw(JSON_VALUES)}), images, False
    if kind == "json":
        return json.dumps(draw(JSON_VALUES)), None, False
    if kind == "nested":  # Deeper than Python's recursion limit is MLflow's 500 (test_fuzz_serving.py).
        return '{"inputs": ' + deeply_nested(draw(st.integers(1, 500))) + "}", None, False
    return draw(st.text(max_size=60)), None, False


# Configuration documents: a deployment form's JSON and the command line's --set, shaped by the config or not.


def _field_values(field) -> st.SearchStrategy:
    """Values for one config field: near its type (the default's kind, a Literal's choices) or any JSON at all."""
    import typing

    default = field.default
    choices = [argument for argument in typing.get_args(field.annotation) if isinstance(argument, str)]
    if typing.get_origin(field.annotation) is typing.Literal:
        near = st.sampled_from(choices) | st.text(max_size=10)
    elif isinstance(default, bool):
        near = st.booleans() | st.sampled_from(["false", "true", 0, 1, "yes"])
    elif isinstance(default, int):
        near = st.integers(-3, 70_000) | st.integers() | st.floats(-1, 100) | st.sampled_from([2**31, 2**63, "3"])
    elif isinstance(default, float):
        near = st.floats() | st.floats(-0.5, 2) | st.integers(-5, 100) | st.sampled_from(["inf", "nan", "1e-3"])
    elif isinstance(default, str):
        near = st.just(default) | st.text(max_size=30) | st.sampled_from(["resnet20", "resnet21", "resnet" + "9" * 40])
    else:
        near = st.none() | st.integers(-2, 100) | st.floats() | st.lists(st.integers(-1, 4), max_size=3)
    return near | JSON_VALUES


@st.composite
def config_documents(draw) -> Any:
    """What a deployment form (or a -p config=... on the command line) submits as the `config` parameter."""
    from cifar.config import PRESETS, PipelineConfig

    if draw(st.integers(0, 19)) == 0:
        return draw(JSON_VALUES)  # Not even a mapping.
    document: dict[str, Any] = {"preset": draw(st.sampled_from(sorted(PRESETS)) | st.text(max_size=8))}
    sections = [
        name for name, field in PipelineConfig.model_fields.items() if hasattr(field.annotation, "model_fields")
    ]
    for section in draw(st.lists(st.sampled_from(sections), max_size=3, unique=True)):
        fields = PipelineConfig.model_fields[section].annotation.model_fields
        chosen = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True))
        document[section] = {name: draw(_field_values(fields[name])) for name in chosen}
    if draw(st.integers(0, 9)) == 0:
        document[draw(st.text(max_size=8))] = draw(JSON_VALUES)  # A field the config does not have.
    if draw(st.booleans()):
        document["seed"] = draw(_field_values(PipelineConfig.model_fields["seed"]))
    return document


@st.composite
def set_assignments(draw) -> list[str]:
    """--set arguments as a person types them: section.field=value, the value JSON or plain text."""
    from cifar.config import PipelineConfig

    assignments = []
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(["train", "data", "validate", "evaluate", "export", "monitor", "tracking"]))
        fields = PipelineConfig.model_fields[section].annotation.model_fields
        name = draw(st.sampled_from(sorted(fields)))
        key = draw(st.just(f"{section}.{name}") | st.text(max_size=12))
        value = draw(
            _field_values(fields[name]).map(json.dumps) | st.text(max_size=20) | NESTING_DEPTHS.map(deeply_nested)
        )
        assignments.append(f"{key}={value}" if draw(st.integers(0, 9)) else key)
    return assignments


# Search-space files: JSON or YAML shaped like a SearchSpace, any JSON, YAML's own constructs, any text.

DISTRIBUTION_TYPES = st.sampled_from(["categorical", "float", "int", "uniform", ""])


@st.composite
def distributions(draw) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": draw(DISTRIBUTION_TYPES)}
    keys = draw(st.lists(st.sampled_from(["choices", "low", "high", "log", "step", "x"]), max_size=4, unique=True))
    values = {
        "choices": st.lists(JSON_LEAVES, max_size=4) | JSON_VALUES,
        "low": st.floats() | st.integers(-10, 10), "high": st.floats() | st.integers(-10, 10) | st.integers(),
        "log": st.booleans() | JSON_LEAVES, "step": st.integers(-2, 5) | JSON_LEAVES, "x": JSON_VALUES,
    }  # fmt: skip
    spec.update({key: draw(values[key]) for key in keys})
    return spec


@st.composite
def space_documents(draw) -> Any:
    """A SearchSpace's mapping, damaged anywhere, or not a mapping at all."""
    from cifar.config import TrainConfig

    fields = st.sampled_from(sorted(TrainConfig.model_fields)) | st.text(max_size=10)
    document: dict[str, Any] = {
        "name": draw(st.sampled_from(["lr-only", "x"]) | st.text(max_size=12)),
        "params": draw(st.dictionaries(fields, distributions(), max_size=3)),
    }
    if draw(st.booleans()):
        document["sampler"] = draw(st.sampled_from(["tpe", "random", "grid"]) | JSON_LEAVES)
    if draw(st.booleans()):
        document["pruner"] = draw(st.fixed_dictionaries({}, optional={
            "kind": st.sampled_from(["median", "halving", "none"]) | JSON_LEAVES,
            "startup_trials": st.integers(-1, 5) | JSON_LEAVES, "min_epochs": st.integers(-1, 5) | JSON_LEAVES,
            "reduction_factor": st.integers(-1, 5) | JSON_LEAVES}))  # fmt: skip
    if draw(st.booleans()):
        document["first_trials"] = draw(st.lists(st.dictionaries(fields, JSON_LEAVES, max_size=2), max_size=2))
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON_VALUES)
    return document


YAML_CONSTRUCTS = [
    "!!python/object/apply:os.system ['touch {marker}']",  # PyYAML's unsafe loader would run it.
    "name: [unclosed",
    "a0: &a0 [x, x, x, x, x, x, x, x]\n"  # Nine levels of eight aliases: 8**9 (134 million) values from 500 bytes.
    + "".join(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 8)}]\n" for level in range(1, 9))
    + "name: lr\nparams: {learning_rate: {type: categorical, choices: *a8}}",
    "name: *undefined",
    "\t- tab",
    "name: !!binary 'not base64!'",
    "? [complex, key]\n: value",
]


@st.composite
def space_files(draw, marker: Path) -> tuple[str, bytes]:
    """(file name, bytes) of a search-space file."""
    suffix = draw(st.sampled_from([".json", ".yaml", ".yml", ".txt", ""]))
    kind = draw(st.sampled_from(["document"] * 6 + ["yaml_construct", "nested", "text", "bytes"]))
    if kind == "document":
        document = draw(space_documents())
        if suffix in (".yaml", ".yml") and draw(st.booleans()):
            import yaml

            text = yaml.safe_dump(document)
        else:
            text = json.dumps(document)  # NaN and Infinity too, as Python writes them.
    elif kind == "yaml_construct":
        text = draw(st.sampled_from(YAML_CONSTRUCTS)).replace("{marker}", str(marker))
    elif kind == "nested":
        text = deeply_nested(draw(NESTING_DEPTHS), *draw(st.sampled_from([("[", "]"), ("{a: ", "}")])))
    elif kind == "text":
        text = draw(st.text(max_size=80))
    else:
        return f"space{suffix}", draw(st.binary(max_size=80))
    return f"space{suffix}", text.encode("utf-8", "surrogatepass")
