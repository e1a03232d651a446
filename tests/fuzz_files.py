"""Hypothesis strategies for the data files a person hands the pipeline (tests/test_fuzz_*.py): pickled batches,
archives in the official layouts and every way of breaking them, NumPy arrays, TFRecord shards.

The strategies of plain values, names, images, folder trees, REST bodies, configs and search spaces, and the
helpers they share (`Sample`, `mutations`, `budget`), are in tests/fuzz_strategies.py.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import pickle
import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fuzz_strategies import JSON_VALUES, Sample, file_names, mutations
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cifar.data.convert import _field, encode_examples, masked_crc32c
from cifar.data.synthetic import BINARY_DIR, CLASS_NAMES, PYTHON_DIR, _binary_batch, _python_batch

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
