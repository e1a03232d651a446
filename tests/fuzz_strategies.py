"""Hypothesis strategies for the fuzz suite (tests/test_fuzz_*.py): what a careless or hostile person hands a door.

Each strategy draws valid inputs among the broken and hostile ones, so a property can check both halves:
what is accepted is read correctly, everything else is refused in one line. The profiles (`ci` in make
test, `fuzz` in make fuzz) are registered in tests/conftest.py; `budget` scales a test's share of them.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import pickle
import stat
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from cifar.data.convert import _field, encode_examples, masked_crc32c
from cifar.data.synthetic import BINARY_DIR, CLASS_NAMES, PYTHON_DIR, _binary_batch, _python_batch


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


# Pickles: batches valid and broken, every protocol; calls of dangerous and of allowed globals.

GADGETS = [  # Callables a crafted pickle reaches for; each would run code or touch files if imported.
    ("os", "system"), ("posix", "system"), ("builtins", "exec"), ("builtins", "eval"), ("__builtin__", "eval"),
    ("subprocess", "check_output"), ("numpy", "load"), ("builtins", "getattr"), ("builtins", "__import__"),
    ("numpy.testing._private.utils", "runstring"), ("shutil", "rmtree"), ("pathlib", "Path"),
]  # fmt: skip
ALLOWED_CALLS = [  # What the restricted unpickler lets a pickle call; the arguments are the attacker's.
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy", "dtype"), ("numpy", "ndarray"), ("_codecs", "encode"),
    ("__builtin__", "bytes"), ("numpy._core.numeric", "_frombuffer"),
]  # fmt: skip
PLAIN_ARGUMENTS = st.recursive(
    st.integers() | st.integers(2**31, 2**64) | st.binary(max_size=16) | st.text(max_size=8) | st.none()
    | st.sampled_from(["latin1", "uint8", "O", "V1000000000", "<U99999999", "b", "C"]),
    lambda inner: st.lists(inner, max_size=4).map(tuple),
    max_leaves=6,
)  # fmt: skip


def call_pickle(module: str, name: str, arguments: tuple, *, stack_global: bool = False) -> bytes:
    """A protocol-2 (or, with STACK_GLOBAL, protocol-4) pickle that calls module.name(*arguments)."""
    arguments_opcodes = pickle.dumps(arguments, 2)[2:-1]  # Without PROTO and STOP; protocol 2 has no frames.
    if stack_global:
        text = lambda value: b"X" + struct.pack("<I", len(value.encode())) + value.encode()  # BINUNICODE
        return b"\x80\x04" + text(module) + text(name) + b"\x93" + arguments_opcodes + b"R."
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + arguments_opcodes + b"R."


@st.composite
def gadget_pickles(draw, marker: Path) -> bytes:
    """A pickle that would create `marker` if anything in it ran, reached by GLOBAL or STACK_GLOBAL."""
    module, name = draw(st.sampled_from(GADGETS))
    command = draw(st.sampled_from([f"touch {marker}", f"open({str(marker)!r}, 'w').close()"]))
    inner = call_pickle(module, name, (command,), stack_global=draw(st.booleans()))
    if draw(st.booleans()):  # Hidden inside a batch: {b"data": <gadget>, b"labels": [0]}.
        inner = b"\x80\x02}(C\x04data" + inner[2:-1] + b"C\x06labels]K\x00au."
    return inner


@st.composite
def allowed_call_pickles(draw) -> bytes:
    module, name = draw(st.sampled_from(ALLOWED_CALLS))
    arguments = draw(st.lists(PLAIN_ARGUMENTS, max_size=4).map(tuple))
    if module.startswith("numpy") and draw(st.booleans()):
        arguments = (np.ndarray, *arguments)  # _reconstruct(ndarray, shape, dtype): the shape is the attacker's.
    return call_pickle(module, name, arguments, stack_global=draw(st.booleans()))


@dataclass(frozen=True, repr=False)
class BatchFile(Sample):
    """A pickle's bytes and, when it is a valid batch, the rows (N, 3072) and labels it must read as."""

    data: bytes
    rows: np.ndarray | None = None
    labels: np.ndarray | None = None
    description: str = ""


LABEL_DAMAGE = st.sampled_from(["out_of_range", "floats", "strings", "nested", "none", "huge", "short", "array"])
DATA_DAMAGE = st.sampled_from(["dtype", "shape", "list", "bytes", "none", "object", "scalar"])


@st.composite
def batch_objects(draw) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
    """(the unpickled object, rows, labels): a batch dict, damaged in one place or not at all."""
    count = draw(st.integers(0, 3))
    rows = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (count, 3072), dtype=np.uint8)
    labels = draw(st.lists(st.integers(0, 9), min_size=count, max_size=count))
    key = draw(st.sampled_from([lambda text: text.encode(), str]))
    label_form = draw(st.sampled_from([list, tuple, lambda values: np.asarray(values, np.int64)]))
    batch = {key("data"): rows, key("labels"): label_form(labels)}
    if draw(st.booleans()):
        batch[key("filenames")] = [f"{index}.png".encode() for index in range(count)]
    damage = draw(st.sampled_from([None, None, "data", "labels", "keys", "top"]))
    if damage is None:
        return batch, rows, np.asarray(labels, np.int64)
    if damage == "labels":
        broken = {
            "out_of_range": [draw(st.integers(10) | st.integers(max_value=-1))] + labels[1:],
            "floats": [float(label) + 0.5 for label in labels] or [0.5], "strings": [str(label) for label in labels],
            "nested": [labels], "none": None, "huge": [2**70] * max(count, 1), "short": labels[:-1] + [0, 0],
            "array": np.asarray(labels, np.float32),
        }[draw(LABEL_DAMAGE)]  # fmt: skip
        batch[key("labels")] = broken
    elif damage == "data":
        batch[key("data")] = {
            "dtype": rows.astype(np.int16), "shape": rows.reshape(count, 3, 1024), "list": rows.tolist(),
            "bytes": rows.tobytes(), "none": None, "object": rows.astype(object), "scalar": np.uint8(7),
        }[draw(DATA_DAMAGE)]  # fmt: skip
    elif damage == "keys":
        del batch[draw(st.sampled_from(sorted(batch, key=str)))]
    else:
        return draw(JSON_VALUES | st.just([rows, labels])), None, None
    return batch, None, None


@st.composite
def batch_files(draw, marker: Path) -> BatchFile:
    """A CIFAR batch file as a labelling vendor (or an attacker) writes it."""
    kind = draw(st.sampled_from(["batch"] * 5 + ["mutated", "gadget", "allowed_call", "random"]))
    if kind == "gadget":
        return BatchFile(draw(gadget_pickles(marker)), description="gadget")
    if kind == "allowed_call":
        return BatchFile(draw(allowed_call_pickles()), description="allowed call")
    if kind == "random":
        return BatchFile(draw(st.binary(max_size=300)), description="random bytes")
    batch, rows, labels = draw(batch_objects())
    protocol = draw(st.integers(0, pickle.HIGHEST_PROTOCOL))
    data = pickle.dumps(batch, protocol=protocol)
    if kind == "mutated":
        return BatchFile(draw(mutations(data)), description=f"mutated protocol {protocol}")
    valid = "valid" if rows is not None else "damaged"
    return BatchFile(data, rows, labels, f"{valid} batch of {len(batch) if isinstance(batch, dict) else '?'} keys, "
                     f"protocol {protocol}")  # fmt: skip


# Archives: the official layouts, then members added, dropped, renamed, duplicated, lied about, compressed, cut.

MEMBER_TYPES = {
    "file": tarfile.REGTYPE, "directory": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
    "fifo": tarfile.FIFOTYPE, "character": tarfile.CHRTYPE, "block": tarfile.BLKTYPE, "contiguous": tarfile.CONTTYPE,
}  # fmt: skip
HOSTILE_MEMBER_NAMES = st.sampled_from(
    ["/etc/cron.d/x", "../x", "cifar-10-batches-py/../../x", "C:\\x", "\\x", "a\\..\\..\\x", "", ".", "./", "//x"]
)


@dataclass
class Member:
    name: str
    kind: str = "file"
    data: bytes = b""
    declared_size: int | None = None  # The size the header states, when it lies about the data.
    linkname: str = ""


@dataclass(frozen=True, repr=False)
class ArchiveFile(Sample):
    """An archive's bytes and, when nothing damaged it, the dataset it must read as."""

    data: bytes
    expected: dict[str, Any] | None
    description: str


def tar_bytes(members: list[Member], tar_format: int) -> bytes:
    """The members as a tar, headers written as given (a lying size too); USTAR falls back to PAX for long names."""
    out = io.BytesIO()
    for member in members:
        info = tarfile.TarInfo(member.name)
        info.type, info.linkname, info.mtime, info.mode = MEMBER_TYPES[member.kind], member.linkname, 0, 0o644
        info.size = len(member.data) if member.declared_size is None else member.declared_size
        try:
            header = info.tobuf(tar_format, "utf-8", "surrogateescape")
        except ValueError:  # Too long, or a size USTAR cannot state.
            header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        out.write(header)
        if member.kind in ("file", "contiguous"):
            out.write(member.data + b"\0" * (-len(member.data) % tarfile.BLOCKSIZE))
    out.write(b"\0" * 2 * tarfile.BLOCKSIZE)
    return out.getvalue()


COMPRESSORS = {
    "tar": lambda data: data, "gz": lambda data: gzip.compress(data, mtime=0), "bz2": bz2.compress,
    "xz": lzma.compress,
}  # fmt: skip


@st.composite
def archives(draw, marker: Path) -> ArchiveFile:
    """A CIFAR-10 archive in either layout with 1-2 images per batch, edited in up to three ways."""
    layout = draw(st.sampled_from(["python", "binary"]))
    directory, suffix, encode_batch = (
        (PYTHON_DIR, "", _python_batch) if layout == "python" else (BINARY_DIR, ".bin", _binary_batch)
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = draw(st.lists(st.integers(1, 2), min_size=6, max_size=6))  # Five training batches, then the test batch.
    splits = [(rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n)) for n in counts]
    members = [
        Member(f"{directory}/{name}{suffix}", data=encode_batch(images, labels, name))
        for name, (images, labels) in zip([f"data_batch_{index}" for index in range(1, 6)] + ["test_batch"], splits)
    ]
    if layout == "python":
        meta = {b"label_names": [name.encode() for name in CLASS_NAMES], b"num_cases_per_batch": 2}
        members.append(Member(f"{directory}/batches.meta", data=pickle.dumps(meta, protocol=2)))
    else:
        members.append(Member(f"{directory}/batches.meta.txt", data="\n".join(CLASS_NAMES).encode() + b"\n"))
    if draw(st.booleans()):
        members.insert(0, Member(directory, "directory"))
    members = draw(st.permutations(members))
    edits = draw(st.lists(st.sampled_from(["replace", "drop", "add", "duplicate", "rename", "lie"]), max_size=3))
    for edit in edits:
        index = draw(st.integers(0, len(members) - 1))
        if edit == "replace":
            members[index] = Member(members[index].name, data=draw(batch_files(marker)).data)
        elif edit == "drop":
            del members[index]
        elif edit == "add":
            name = draw(HOSTILE_MEMBER_NAMES | file_names | st.sampled_from([member.name for member in members]))
            kind = draw(st.sampled_from(sorted(MEMBER_TYPES)))
            linkname = draw(st.sampled_from(["/etc/passwd", "../x", members[0].name]))
            members.insert(index, Member(name, kind, draw(st.binary(max_size=64)), linkname=linkname))
        elif edit == "duplicate":
            members.insert(index, members[index])
        elif edit == "rename":
            members[index] = Member(draw(HOSTILE_MEMBER_NAMES), members[index].kind, members[index].data)
        else:
            members[index].declared_size = draw(st.integers(0, 4096) | st.integers(2**29, 2**40))
        if not members:
            break
    compression = draw(st.sampled_from(sorted(COMPRESSORS)))
    data = COMPRESSORS[compression](tar_bytes(members, draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT,
                                                                              tarfile.USTAR_FORMAT]))))  # fmt: skip
    damage = draw(st.sampled_from([None, None, None, "truncate", "mutate"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif damage == "mutate":
        data = draw(mutations(data))
    expected = None
    if not edits and damage is None:
        train = splits[:5]
        expected = {
            "train_images": np.concatenate([images for images, _ in train]),
            "train_labels": np.concatenate([labels for _, labels in train]),
            "test_images": splits[5][0],
            "test_labels": splits[5][1],
            "class_names": list(CLASS_NAMES),
        }
    return ArchiveFile(data, expected, f"{layout} {compression} edits={edits} damage={damage}")


# Arrays saved with NumPy: valid image arrays, other arrays, pickled objects, headers that lie.

NPY_DTYPES = st.sampled_from(["uint8", "int64", "float32", "bool", "<U3", "complex64", "uint16", ">u2"])


@dataclass(frozen=True, repr=False)
class NpyFile(Sample):
    data: bytes
    images: np.ndarray | None = None  # What a reader must return, when the file is a valid image array.
    description: str = ""


def npy_bytes(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


@st.composite
def npy_files(draw) -> NpyFile:
    kind = draw(st.sampled_from(["images", "images", "array", "object", "npz", "header", "mutated", "random"]))
    count = draw(st.integers(0, 3))
    images = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (count, 32, 32, 3), np.uint8)
    if kind == "images":
        fortran = draw(st.booleans())
        return NpyFile(npy_bytes(np.asfortranarray(images) if fortran else images), images, f"images fortran={fortran}")
    if kind == "array":
        array = draw(hnp.arrays(NPY_DTYPES, hnp.array_shapes(min_dims=0, max_dims=5, max_side=4)))
        return NpyFile(npy_bytes(array), None, f"{array.dtype} {array.shape}")
    if kind == "object":
        return NpyFile(npy_bytes(np.array([images, "x", None], dtype=object), allow_pickle=True), None, "objects")
    if kind == "npz":
        buffer = io.BytesIO()
        np.savez(buffer, images=images)
        return NpyFile(buffer.getvalue(), None, "npz")
    if kind == "header":  # The header states a shape (and type) the data does not hold.
        shape = draw(st.lists(st.integers(0, 40) | st.integers(2**31, 2**62), min_size=0, max_size=5).map(tuple))
        header = {"descr": draw(st.sampled_from(["|u1", "<i8", "|O", "|V0", "<U99999999"])), "fortran_order": False,
                  "shape": shape}  # fmt: skip
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, header)
        return NpyFile(buffer.getvalue() + images.tobytes()[:64], None, f"header {header}")
    if kind == "mutated":
        return NpyFile(draw(mutations(npy_bytes(images))), None, "mutated")
    return NpyFile(draw(st.binary(max_size=200)), None, "random bytes")


# TFRecord shards: our records, other Examples, framing that lies.


def frame(payload: bytes, *, length: int | None = None, good_crc: bool = True) -> bytes:
    """One TFRecord: length, masked CRC of the length, payload, masked CRC of the payload."""
    header = struct.pack("<Q", len(payload) if length is None else length)
    payload_crc = masked_crc32c(payload) ^ (0 if good_crc else 1)
    return header + struct.pack("<I", masked_crc32c(header)) + payload + struct.pack("<I", payload_crc)


def example(features: dict[str, bytes]) -> bytes:
    """A serialized tf.train.Example whose features are BytesLists of one value each."""
    entries = b"".join(_field(1, _field(1, name.encode()) + _field(2, _field(1, _field(1, value))))
                       for name, value in features.items())  # fmt: skip
    return _field(1, entries)


@dataclass(frozen=True, repr=False)
class TFRecordFile(Sample):
    data: bytes
    images: np.ndarray | None = None
    description: str = ""


@st.composite
def tfrecord_files(draw) -> TFRecordFile:
    count = draw(st.integers(0, 3))
    images = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (count, 32, 32, 3), np.uint8)
    payloads = [bytes(row) for row in encode_examples(images, np.zeros(count, np.int64))]
    damage = draw(st.sampled_from([None, None, "payload", "length", "crc", "truncate", "append", "random"]))
    if damage == "payload":  # Another Example in place of one of ours: no image, or one of another length.
        image = draw(st.binary(max_size=40) | st.just(bytes(3073)))
        other = example(draw(st.sampled_from([{"image": image}, {"label": image}, {}])))
        payloads.insert(draw(st.integers(0, count)), draw(st.sampled_from([other, image])))
    records = [frame(payload) for payload in payloads]
    if damage == "length":  # A header stating more (or fewer) bytes than follow, with a valid CRC of its own.
        records.append(frame(b"x" * 100, length=draw(st.integers(0, 99) | st.integers(101, 2**63))))
    elif damage == "crc":
        records.append(frame(payloads[0] if payloads else b"x", good_crc=False))
    data = b"".join(records)
    if damage == "truncate":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif damage == "append":
        data += draw(st.binary(min_size=1, max_size=20))
    elif damage == "random":
        data = draw(st.binary(max_size=200))
    return TFRecordFile(data, images if damage is None else None, f"{count} records, damage={damage}")


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
