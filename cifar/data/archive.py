"""Reading the CIFAR-10 archive safely, and refusing what is not CIFAR-10: member checks, safe extraction,
a restricted unpickler, both layouts, and the checks of rows, labels, class names and counts.

The archive comes from the internet, so nothing in it is trusted: every member is checked before its
bytes are used, pickles can build numpy arrays and plain containers only, and a damaged gzip stream is
one `CorruptArchiveError` (docs/RELIABILITY.md, "Hostile archives").
"""

from __future__ import annotations

import contextlib
import gzip
import io
import pickle
import pickletools
import shutil
import tarfile
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from cifar.config import TEST_EXAMPLES, TRAIN_EXAMPLES, DataConfig
from cifar.data.manifest import IMAGE_BYTES, IMAGE_SHAPE, NUM_CLASSES
from cifar.io import atomic_directory

try:  # ISA-L inflates gzip about twice as fast as zlib; without it the standard library does the work.
    from isal import igzip, isal_zlib
except ImportError:  # pragma: no cover - isal is a declared dependency.
    igzip = isal_zlib = None

try:  # NumPy 2 moved the array reconstructor to numpy._core; NumPy 1 only has numpy.core.
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:  # pragma: no cover - depends on the installed NumPy.
    from numpy.core.multiarray import _reconstruct, scalar

MAX_MEMBER_BYTES = 512 * 2**20  # The largest official member is ~31 MB; anything this big is hostile.
MAX_TOTAL_BYTES = 2 * 2**30  # The official archives unpack to ~180 MB; this bounds a decompression bomb.
MAX_MEMBERS = 1_000  # The official archives hold 9 members; tarfile keeps every header in memory.
NUM_TRAIN_BATCHES = 5
BINARY_RECORD_BYTES = 1 + IMAGE_BYTES  # One label byte, then the pixels.
GZIP_MAGIC = b"\x1f\x8b"
STREAM_BUFFER_BYTES = 1 << 20  # tarfile's default 10 KiB reads cost ~15% more CPU on the 170 MB archive.
# What a truncated or damaged archive raises, from tarfile, zlib, gzip or ISA-L.
CORRUPTION_ERRORS: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) + (
    (isal_zlib.error,) if isal_zlib is not None else ()
)

# The two official layouts. python: pickled dicts data_batch_1..5 and test_batch (`data`: uint8 (N, 3072),
# `labels`: a list of ints) and batches.meta (`label_names`). binary: data_batch_1..5.bin and test_batch.bin
# (records of 1 label byte and 3,072 pixel bytes) and batches.meta.txt (one class name per line).
PYTHON_LAYOUT = "python"
BINARY_LAYOUT = "binary"
LAYOUT_DIRECTORIES = {PYTHON_LAYOUT: "cifar-10-batches-py", BINARY_LAYOUT: "cifar-10-batches-bin"}
TRAIN_FILES = {
    PYTHON_LAYOUT: tuple(f"data_batch_{index}" for index in range(1, NUM_TRAIN_BATCHES + 1)),
    BINARY_LAYOUT: tuple(f"data_batch_{index}.bin" for index in range(1, NUM_TRAIN_BATCHES + 1)),
}
TEST_FILE = {PYTHON_LAYOUT: "test_batch", BINARY_LAYOUT: "test_batch.bin"}
META_FILE = {PYTHON_LAYOUT: "batches.meta", BINARY_LAYOUT: "batches.meta.txt"}
NEEDED_FILES = {layout: (*TRAIN_FILES[layout], TEST_FILE[layout], META_FILE[layout]) for layout in LAYOUT_DIRECTORIES}
# The members either layout reads, as 'directory/name'; any other member is checked, then skipped.
WANTED_MEMBERS = frozenset(
    f"{LAYOUT_DIRECTORIES[layout]}/{name}" for layout in NEEDED_FILES for name in NEEDED_FILES[layout]
)
MEMBER_KINDS = {tarfile.CHRTYPE: "character device", tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "fifo"}


class UnsafeArchiveError(ValueError):
    """A tar member could escape the target directory or is not a plain file or directory."""


class CorruptArchiveError(ValueError):
    """The archive cannot be read to the end: truncated, or not a (gzipped) tar at all."""


class UnsafePickleError(ValueError):
    """A pickle asked for something other than the numpy arrays and containers a CIFAR batch holds."""


class UnknownLayoutError(ValueError):
    """The archive holds neither official CIFAR-10 layout (or is missing some of its files)."""


@dataclass(frozen=True)
class RawDataset:
    """The archive's images and labels, checked for shape and range, in HWC order."""

    train_images: np.ndarray  # (N, 32, 32, 3) uint8
    train_labels: np.ndarray  # (N,) int64
    test_images: np.ndarray  # (M, 32, 32, 3) uint8
    test_labels: np.ndarray  # (M,) int64
    class_names: list[str]
    layout: str  # "python" or "binary".


# Content checks: a batch while it is read (an error names its file), the assembled dataset against the
# config. Anything not CIFAR-10 shaped (rows, labels, class names, counts) is an InvalidDatasetError.


class InvalidDatasetError(ValueError):
    """The archive's contents are not a well-formed CIFAR-10 dataset."""


def validate_batch(name: str, data: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Checks one batch (`data` uint8 (N, 3072), N labels in 0..9); returns (rows, labels as int64)."""
    if not isinstance(data, np.ndarray):
        raise InvalidDatasetError(f"{name}: data is a {type(data).__name__}, expected a numpy array")
    if data.dtype != np.uint8:
        raise InvalidDatasetError(f"{name}: data has dtype {data.dtype}, expected uint8")
    if data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        raise InvalidDatasetError(f"{name}: data has shape {data.shape}, expected (N, {IMAGE_BYTES})")
    # A flat list is checked before numpy sees it: nested lists sharing one memoised list would expand to billions.
    flat = isinstance(labels, np.ndarray) or (
        isinstance(labels, (list, tuple)) and all(isinstance(item, (int, np.integer)) for item in labels)
    )
    if not flat:
        raise InvalidDatasetError(f"{name}: labels are a {type(labels).__name__}, expected a flat list of integers")
    array = np.asarray(labels)
    if array.ndim != 1:
        raise InvalidDatasetError(f"{name}: labels have shape {array.shape}, expected a flat list")
    if len(array) and not np.issubdtype(array.dtype, np.integer):
        raise InvalidDatasetError(f"{name}: labels have type {array.dtype}, expected integers")
    if len(array) != len(data):
        raise InvalidDatasetError(f"{name}: {len(array)} labels for {len(data)} images")
    labels = array.astype(np.int64)
    _check_label_range(name, labels)
    return data, labels


def _check_label_range(name: str, labels: np.ndarray) -> None:
    """Every label must be a class index."""
    outside = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
    if len(outside):
        first = int(outside[0])
        raise InvalidDatasetError(
            f"{name}: {len(outside)} labels outside 0..{NUM_CLASSES - 1}, "
            f"first at index {first} (value {int(labels[first])})"
        )


def validate_class_names(name: str, class_names: list[Any]) -> list[str]:
    """Exactly 10 distinct, non-empty class names."""
    if len(class_names) != NUM_CLASSES:
        raise InvalidDatasetError(f"{name}: {len(class_names)} class names, expected {NUM_CLASSES}")
    if not all(isinstance(item, str) and item.strip() for item in class_names):
        raise InvalidDatasetError(f"{name}: class names must be non-empty strings, got {class_names!r}")
    if len(set(class_names)) != NUM_CLASSES:
        raise InvalidDatasetError(f"{name}: class names are not distinct: {class_names!r}")
    return list(class_names)


def _validate_split(split: str, images: np.ndarray, labels: np.ndarray) -> None:
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise InvalidDatasetError(
            f"{split} images have shape {images.shape} and dtype {images.dtype}, expected (N, 32, 32, 3) uint8"
        )
    if labels.ndim != 1 or len(labels) != len(images):
        raise InvalidDatasetError(f"{split}: {labels.shape[0] if labels.ndim else 0} labels for {len(images)} images")
    _check_label_range(split, labels)


def validate_dataset(dataset: RawDataset, config: DataConfig) -> None:
    """Checks the assembled dataset's shapes, labels, class names and counts against `config`."""
    _validate_split("train", dataset.train_images, dataset.train_labels)
    _validate_split("test", dataset.test_images, dataset.test_labels)
    validate_class_names("class names", dataset.class_names)
    num_train, num_test = len(dataset.train_images), len(dataset.test_images)
    if config.expect_official_counts and (num_train, num_test) != (TRAIN_EXAMPLES, TEST_EXAMPLES):
        raise InvalidDatasetError(
            f"archive holds {num_train:,} training and {num_test:,} test images, expected the official "
            f"{TRAIN_EXAMPLES:,} and {TEST_EXAMPLES:,} (set data.expect_official_counts to false for other sizes)"
        )
    if num_test == 0:
        raise InvalidDatasetError("archive holds no test images")
    if config.validation_size >= num_train:
        raise InvalidDatasetError(
            f"validation_size {config.validation_size:,} leaves no training images out of {num_train:,}"
        )


# Member checks and extraction.


def check_member(member: tarfile.TarInfo, total_bytes: int = 0) -> None:
    """Raises UnsafeArchiveError unless `member` is a plain file or directory that stays inside the target."""
    name = member.name
    if not name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"archive member {name!r} has an absolute path")
    # Backslashes count as separators too, so 'a\..\b' is caught as well as 'a/../b'.
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if ".." in parts:
        raise UnsafeArchiveError(f"archive member {name!r} contains '..' and could escape the target directory")
    if not parts and not member.isdir():  # '.' or './' names the target directory itself.
        raise UnsafeArchiveError(f"archive member {name!r} is a file named as the archive's top directory")
    if member.issym() or member.islnk():
        raise UnsafeArchiveError(f"archive member {name!r} is a link to {member.linkname!r}; links are not allowed")
    if not (member.isfile() or member.isdir()):
        kind = MEMBER_KINDS.get(member.type, f"member of type {member.type!r}")
        raise UnsafeArchiveError(f"archive member {name!r} is a {kind}; only files and directories are allowed")
    if member.size > MAX_MEMBER_BYTES:
        raise UnsafeArchiveError(
            f"archive member {name!r} is {member.size:,} bytes, over the {MAX_MEMBER_BYTES:,} byte limit"
        )
    if total_bytes + member.size > MAX_TOTAL_BYTES:
        raise UnsafeArchiveError(f"archive member {name!r} takes the archive over {MAX_TOTAL_BYTES:,} unpacked bytes")


@contextlib.contextmanager
def _open_tar_stream(archive_path: Path) -> Iterator[tarfile.TarFile]:
    """The archive as a front-to-back tar stream: gzip through ISA-L when installed, else tarfile's own."""
    with open(archive_path, "rb") as raw:
        is_gzip = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        if is_gzip and igzip is not None:
            with (
                igzip.IGzipFile(fileobj=raw, mode="rb") as stream,
                tarfile.open(fileobj=stream, mode="r|", bufsize=STREAM_BUFFER_BYTES) as archive,
            ):
                yield archive
        else:
            # "r|*" decompresses once, front to back, and accepts gzip, bzip2, xz or a plain tar.
            with tarfile.open(fileobj=raw, mode="r|*", bufsize=STREAM_BUFFER_BYTES) as archive:
                yield archive


def _scan_archive(
    archive_path: str | Path,
    on_file: Callable[[tarfile.TarInfo, io.BufferedReader], None],
    on_directory: Callable[[tarfile.TarInfo], None] = lambda member: None,
) -> None:
    """Streams the archive once, checking every member before handing its bytes to the callbacks."""
    archive_path = Path(archive_path)
    if not archive_path.is_file():
        raise FileNotFoundError(f"archive not found: {archive_path}")
    total_bytes = 0
    seen: set[PurePosixPath] = set()
    try:
        with _open_tar_stream(archive_path) as archive:
            for count, member in enumerate(archive, start=1):
                if count > MAX_MEMBERS:
                    raise UnsafeArchiveError(f"archive has more than {MAX_MEMBERS:,} members (at {member.name!r})")
                check_member(member, total_bytes)
                total_bytes += member.size
                if member.isdir():
                    on_directory(member)
                    continue
                # A second member of the same name would silently replace the first one's bytes.
                if PurePosixPath(member.name) in seen:
                    raise UnsafeArchiveError(f"archive member {member.name!r} appears more than once")
                seen.add(PurePosixPath(member.name))
                on_file(member, archive.extractfile(member))
    except CORRUPTION_ERRORS as error:
        raise CorruptArchiveError(f"archive is truncated or corrupt: {archive_path}: {error}") from error


def safe_extract(archive_path: str | Path, target_dir: str | Path) -> Path:
    """Extracts every member into `target_dir` (created; must be empty) after checking it; returns the target.

    The members land in a temporary directory beside the target that is renamed at the end, so a
    rejected or corrupt archive leaves no target directory behind.
    """
    target = Path(target_dir).expanduser().absolute()
    if target.exists():
        if not target.is_dir() or any(target.iterdir()):
            raise ValueError(f"extraction target {target} exists and is not an empty directory")
        target.rmdir()
    with atomic_directory(target) as temp:
        root = temp.resolve()

        def destination(member: tarfile.TarInfo) -> Path:
            path = (root / member.name).resolve()
            # Defence in depth: check_member already rejected '..' and absolute names.
            if not path.is_relative_to(root):
                raise UnsafeArchiveError(f"archive member {member.name!r} resolves outside {target}")
            return path

        @contextlib.contextmanager
        def creating(member: tarfile.TarInfo) -> Iterator[Path]:
            """The member's path, its creation refused when another member already made it the other kind."""
            try:
                yield destination(member)
            except (FileExistsError, NotADirectoryError, IsADirectoryError):
                raise UnsafeArchiveError(
                    f"archive member {member.name!r} clashes with another member (a file where a directory is, or "
                    "the reverse)"
                ) from None

        def write_file(member: tarfile.TarInfo, reader: io.BufferedReader) -> None:
            with creating(member) as path:
                path.parent.mkdir(parents=True, exist_ok=True)
                # "xb" never follows or overwrites an existing entry; file modes from the archive are ignored.
                with open(path, "xb") as handle:
                    shutil.copyfileobj(reader, handle, 1 << 20)

        def make_directory(member: tarfile.TarInfo) -> None:
            with creating(member) as path:
                path.mkdir(parents=True, exist_ok=True)

        _scan_archive(archive_path, write_file, make_directory)
    return target


# The restricted unpickler.


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """What protocol-2 pickles written by Python 3 call to rebuild a bytes object, limited to latin-1."""
    if encoding.replace("-", "").replace("_", "").lower() != "latin1" or not isinstance(text, str):
        raise UnsafePickleError(f"pickle calls _codecs.encode with encoding {encoding!r}; only latin-1 is allowed")
    return text.encode("latin-1")


def _empty_bytes(*arguments: Any) -> bytes:
    """What protocol-2 pickles written by Python 3 call for an empty bytes object (an empty batch's pixels): bytes()."""
    if arguments:  # bytes(n) would allocate n bytes the pickle never held.
        raise UnsafePickleError(f"pickle calls bytes{arguments!r}; only bytes() (empty) is allowed")
    return b""


def _plain_dtype(spec: Any, align: Any = False, copy: Any = True) -> np.dtype:
    """numpy.dtype as pickles call it (`dtype('u1', False, True)`; Python 2's: bytes and 0/1), refusing object dtypes
    (whose arrays would unpickle arbitrary objects) and any other call."""
    if not isinstance(spec, (str, bytes)) or align not in (0, 1) or copy not in (0, 1):
        raise UnsafePickleError(f"pickle calls numpy.dtype{(spec, align, copy)!r}; only a type name is allowed")
    dtype = np.dtype(spec.decode("latin-1") if isinstance(spec, bytes) else spec)
    if dtype.hasobject:
        raise UnsafePickleError(f"pickle asks for an object dtype {dtype!r}; only plain numeric arrays are allowed")
    return dtype


def _empty_array(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's _reconstruct as array pickles call it: an empty ndarray, which the pickle's state then fills (and
    which checks that state's bytes against its shape). Any other shape would allocate what the pickle never held."""
    if subtype is not np.ndarray or shape != (0,):
        raise UnsafePickleError(f"pickle calls numpy _reconstruct with {subtype!r}, {shape!r}; only an empty array")
    return _reconstruct(np.ndarray, (0,), dtype)


def _array_from_buffer(buffer: Any, dtype: Any, shape: Any, order: Any, axis_order: Any = None) -> np.ndarray:
    """numpy's _frombuffer, which protocol-5 pickles call to rebuild an array: only over bytes the pickle holds, of a
    plain dtype, in a shape those bytes fill exactly (numpy's reshape refuses any other)."""
    if not isinstance(buffer, (bytes, bytearray)) or not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise UnsafePickleError("pickle calls numpy _frombuffer on something other than plain bytes and a plain dtype")
    if order not in ("C", "F") or axis_order is not None:
        raise UnsafePickleError(f"pickle calls numpy _frombuffer with order {order!r}; only 'C' or 'F' are allowed")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


# Everything a CIFAR batch needs beyond what the pickle machine builds natively (dict, list, str, bytes,
# int). NumPy 1 writes `numpy.core.*`, NumPy 2 writes `numpy._core.*`; protocol 5 rebuilds arrays with _frombuffer.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _empty_array,
    ("numpy._core.multiarray", "_reconstruct"): _empty_array,
    ("numpy.core.multiarray", "scalar"): scalar,
    ("numpy._core.multiarray", "scalar"): scalar,
    ("numpy.core.numeric", "_frombuffer"): _array_from_buffer,
    ("numpy._core.numeric", "_frombuffer"): _array_from_buffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _plain_dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("__builtin__", "bytes"): _empty_bytes,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can only rebuild numpy arrays and plain containers: nothing is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"pickle references {module}.{name}, which a CIFAR batch never needs; refusing to load it"
            ) from None

    def persistent_load(self, persistent_id: Any) -> Any:
        raise UnsafePickleError(f"pickle uses persistent id {persistent_id!r}; refusing to load it")


MEMO_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def check_pickle_lengths(data: bytes, name: str) -> None:
    """Reads every opcode once, building nothing: a length, frame or memo index beyond what the pickle's own bytes
    can hold is refused here, because the unpickler allocates what a pickle states before it reads the bytes (a
    9-byte BYTEARRAY8 or LONG_BINPUT would take gigabytes)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # A string with an invalid escape warns: malformed, like the rest.
            for count, (opcode, argument, position) in enumerate(pickletools.genops(data)):
                if opcode.name == "FRAME" and argument > len(data) - position:
                    raise ValueError(f"a frame of {argument:,} bytes at byte {position} runs past the end")
                if opcode.name in MEMO_OPCODES and argument > count:  # Pickles number their memo entries 0, 1, ...
                    raise ValueError(f"memo index {argument:,} at byte {position}")
    except (ValueError, Warning) as error:  # pickletools' own, for a length past the end or an unknown opcode too.
        raise InvalidDatasetError(f"{name}: not a readable CIFAR pickle: {error}") from None


def load_pickle(data: bytes, name: str) -> Any:
    """Unpickles `data` (from member `name`) with RestrictedUnpickler; bytes keys and strings stay bytes."""
    check_pickle_lengths(data, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # encoding="bytes" reads the official Python 2 pickles: their str values arrive as bytes.
            return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except UnsafePickleError as error:
        raise UnsafePickleError(f"{name}: {error}") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        Warning,
    ) as error:
        raise InvalidDatasetError(f"{name}: not a readable CIFAR pickle: {type(error).__name__}: {error}") from error


def _text_keys(value: Any, name: str) -> dict[str, Any]:
    """A pickled dict with its bytes keys decoded to str."""
    if not isinstance(value, dict):
        raise InvalidDatasetError(f"{name}: expected a pickled dict, got {type(value).__name__}")
    return {key.decode("latin-1") if isinstance(key, bytes) else str(key): item for key, item in value.items()}


# Layout readers: member bytes in, validated rows and labels out.


def parse_python_batch(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    batch = _text_keys(load_pickle(data, name), name)
    if "data" not in batch or "labels" not in batch:
        raise InvalidDatasetError(f"{name}: batch has keys {sorted(batch)}, expected 'data' and 'labels'")
    return validate_batch(name, batch["data"], batch["labels"])


def _python_class_names(data: bytes, name: str) -> list[str]:
    meta = _text_keys(load_pickle(data, name), name)
    if "label_names" not in meta:
        raise InvalidDatasetError(f"{name}: metadata has keys {sorted(meta)}, expected 'label_names'")
    names = meta["label_names"]
    if not isinstance(names, (list, tuple)):
        raise InvalidDatasetError(f"{name}: label_names is a {type(names).__name__}, expected a list")
    # Class names in the official pickles are bytes.
    return validate_class_names(name, [item.decode("utf-8") if isinstance(item, bytes) else item for item in names])


def _binary_batch(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    if len(data) == 0 or len(data) % BINARY_RECORD_BYTES:
        raise InvalidDatasetError(
            f"{name}: {len(data):,} bytes is not a whole number of {BINARY_RECORD_BYTES}-byte records"
        )
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, BINARY_RECORD_BYTES)  # (N, 1 + 3072)
    return validate_batch(name, records[:, 1:], records[:, 0])


def _binary_class_names(data: bytes, name: str) -> list[str]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidDatasetError(f"{name}: class names are not UTF-8 text: {error}") from error
    return validate_class_names(name, [line.strip() for line in text.splitlines() if line.strip()])


BATCH_READERS = {PYTHON_LAYOUT: parse_python_batch, BINARY_LAYOUT: _binary_batch}
CLASS_NAME_READERS = {PYTHON_LAYOUT: _python_class_names, BINARY_LAYOUT: _binary_class_names}


def rows_to_images(batches: list[np.ndarray]) -> np.ndarray:
    """Official rows (R plane, G plane, B plane) -> one (N, 32, 32, 3) HWC array, in a single copy.

    A row's 3,072 bytes are the red plane, then green, then blue (1,024 bytes each, row-major); every
    later stage uses HWC order.
    """
    total = sum(len(rows) for rows in batches)
    images = np.empty((total, 32 * 32, 3), dtype=np.uint8)
    start = 0
    for rows in batches:
        planes = rows.reshape(-1, 3, 32 * 32)  # (n, channel, pixel)
        # One channel at a time: a contiguous read and a stride-3 write is about twice as fast as
        # numpy's general 4-D transpose copy.
        for channel in range(3):
            images[start : start + len(rows), :, channel] = planes[:, channel, :]
        start += len(rows)
    return images.reshape(total, 32, 32, 3)


def detect_layout(names: list[str] | set[str]) -> str:
    """The layout whose directory holds files among `names` (paths like 'cifar-10-batches-py/test_batch')."""
    found = [
        layout
        for layout, directory in LAYOUT_DIRECTORIES.items()
        if any(PurePosixPath(name).parts[:1] == (directory,) for name in names)
    ]
    if not found:
        raise UnknownLayoutError(
            "archive holds neither official CIFAR-10 layout: expected a folder "
            f"{LAYOUT_DIRECTORIES[PYTHON_LAYOUT]}/ or {LAYOUT_DIRECTORIES[BINARY_LAYOUT]}/"
        )
    if len(found) > 1:
        raise UnknownLayoutError("archive holds both the python and the binary layout; expected exactly one")
    return found[0]


def parse_layout(files: Mapping[str, bytes], layout: str, *, all_batches: bool = True) -> RawDataset:
    """Builds the RawDataset from a layout's files (`files` maps 'dir/name' -> bytes).

    Every training batch must be there unless `all_batches` is false (an archive that holds fewer,
    e.g. the official one with a batch left out to be added later as new data): then at least one.
    """
    directory = LAYOUT_DIRECTORIES[layout]
    present = [name for name in TRAIN_FILES[layout] if f"{directory}/{name}" in files]
    optional = set() if all_batches or not present else set(TRAIN_FILES[layout])
    missing = [name for name in NEEDED_FILES[layout] if f"{directory}/{name}" not in files and name not in optional]
    if missing:
        hint = (
            " (an archive with fewer training batches needs data.expect_official_counts false)" if all_batches else ""
        )
        raise UnknownLayoutError(f"{directory}/ is missing {', '.join(missing)}{hint}")
    read = lambda reader, name: reader(files[f"{directory}/{name}"], f"{directory}/{name}")
    train = [read(BATCH_READERS[layout], name) for name in present]
    test_rows, test_labels = read(BATCH_READERS[layout], TEST_FILE[layout])
    return RawDataset(
        train_images=rows_to_images([rows for rows, _ in train]),
        train_labels=np.concatenate([labels for _, labels in train]),
        test_images=rows_to_images([test_rows]),
        test_labels=test_labels,
        class_names=read(CLASS_NAME_READERS[layout], META_FILE[layout]),
        layout=layout,
    )


def read_archive(archive_path: str | Path, *, all_batches: bool = True) -> RawDataset:
    """Reads a CIFAR-10 archive in either official layout straight from the tar, checking every member.

    One pass, into memory, no temporary files; `safe_extract` applies the same checks writing to a folder.

    `all_batches=False` accepts an archive that lacks some training batches (`parse_layout`).
    """
    files: dict[str, bytes] = {}

    def keep(member: tarfile.TarInfo, reader: io.BufferedReader) -> None:
        name = str(PurePosixPath(member.name))
        if name in WANTED_MEMBERS:
            files[name] = reader.read()

    _scan_archive(archive_path, keep)
    return parse_layout(files, detect_layout(set(files)), all_batches=all_batches)


def read_directory(directory: str | Path) -> RawDataset:
    """Reads an extracted archive (the folder holding `cifar-10-batches-py/` or `cifar-10-batches-bin/`)."""
    directory = Path(directory)
    present = {name for name in WANTED_MEMBERS if (directory / name).is_file()}
    # detect_layout rejects both layouts at once, so every present file belongs to the one detected.
    layout = detect_layout(present)
    return parse_layout({name: (directory / name).read_bytes() for name in present}, layout)
