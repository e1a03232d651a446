"""Reading the archive: safe extraction, the restricted unpickler, both layouts, and clear errors."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from cifar.data import archive as archive_module
from cifar.data.archive import (
    CorruptArchiveError,
    InvalidDatasetError,
    RestrictedUnpickler,
    UnknownLayoutError,
    UnsafeArchiveError,
    UnsafePickleError,
    load_pickle,
    parse_python_batch,
    read_archive,
    read_directory,
    safe_extract,
)
from cifar.data.synthetic import CLASS_NAMES, source_arrays

TRAIN_PER_BATCH = 100  # The conftest fixtures: 5 batches of 100 training images, 200 test images.
TEST_EXAMPLES = 200
PY_DIR = "cifar-10-batches-py"
BIN_DIR = "cifar-10-batches-bin"


# Helpers that build archives member by member.


def _file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, data


def _special_member(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def _write_archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _fixture_members(archive_path: str) -> dict[str, bytes]:
    """The fixture archive's regular files by name (the fixture is ours, so reading it plainly is fine)."""
    with tarfile.open(archive_path, "r:gz") as archive:
        return {member.name: archive.extractfile(member).read() for member in archive if member.isfile()}


def _replaced(archive_path: str, target: Path, replacements: dict[str, bytes | None]) -> Path:
    """A copy of the fixture archive with some members replaced (bytes) or removed (None)."""
    files = _fixture_members(archive_path)
    for name, data in replacements.items():
        if data is None:
            files.pop(name)
        else:
            files[name] = data
    return _write_archive(target, [_file_member(name, data) for name, data in files.items()])


def _python_batch(data: object, labels: object) -> bytes:
    return pickle.dumps({b"batch_label": b"test", b"data": data, b"labels": labels}, protocol=2)


# Reading valid archives.


def test_python_layout_matches_the_source_images(python_archive):
    dataset = read_archive(python_archive)
    expected = source_arrays(train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES)
    assert dataset.layout == "python"
    assert dataset.class_names == list(CLASS_NAMES)
    assert dataset.train_images.shape == (5 * TRAIN_PER_BATCH, 32, 32, 3)
    assert dataset.train_images.dtype == np.uint8 and dataset.train_labels.dtype == np.int64
    np.testing.assert_array_equal(dataset.train_images, expected["train"][0])
    np.testing.assert_array_equal(dataset.train_labels, expected["train"][1])
    np.testing.assert_array_equal(dataset.test_images, expected["test"][0])
    np.testing.assert_array_equal(dataset.test_labels, expected["test"][1])


def test_binary_layout_reads_the_same_pixels_as_the_python_layout(python_archive, binary_archive):
    from_python, from_binary = read_archive(python_archive), read_archive(binary_archive)
    assert from_binary.layout == "binary"
    assert from_binary.class_names == from_python.class_names
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(from_binary, field), getattr(from_python, field))


@pytest.mark.parametrize("layout", ["python", "binary"])
def test_safe_extract_writes_the_layout_and_reads_back_identically(python_archive, binary_archive, tmp_path, layout):
    source = python_archive if layout == "python" else binary_archive
    target = safe_extract(source, tmp_path / "extracted")
    folder = PY_DIR if layout == "python" else BIN_DIR
    assert (target / folder).is_dir()
    assert sorted(os.listdir(tmp_path)) == ["extracted"]  # No temporary directory left beside it.
    from_directory, from_archive = read_directory(target), read_archive(source)
    np.testing.assert_array_equal(from_directory.train_images, from_archive.train_images)
    np.testing.assert_array_equal(from_directory.test_labels, from_archive.test_labels)


def test_safe_extract_refuses_a_non_empty_target(python_archive, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory"):
        safe_extract(python_archive, tmp_path / "target")
    assert (tmp_path / "target" / "keep.txt").read_text() == "mine"


# Malicious archives.

MALICIOUS_MEMBERS = {
    "path traversal": (lambda: _file_member("../evil", b"x"), "'..'"),
    "nested traversal": (lambda: _file_member(f"{PY_DIR}/../../evil", b"x"), "'..'"),
    "absolute path": (lambda: _file_member("/tmp/cifar-test-evil", b"x"), "absolute path"),
    "symlink": (lambda: _special_member(f"{PY_DIR}/link", tarfile.SYMTYPE, "/etc/passwd"), "link"),
    "hardlink": (lambda: _special_member(f"{PY_DIR}/hard", tarfile.LNKTYPE, f"{PY_DIR}/readme.html"), "link"),
    "character device": (lambda: _special_member(f"{PY_DIR}/tty", tarfile.CHRTYPE), "character device"),
    "block device": (lambda: _special_member(f"{PY_DIR}/disk", tarfile.BLKTYPE), "block device"),
    "fifo": (lambda: _special_member(f"{PY_DIR}/pipe", tarfile.FIFOTYPE), "fifo"),
}


@pytest.mark.parametrize("case", sorted(MALICIOUS_MEMBERS))
def test_malicious_members_are_rejected_and_nothing_is_written(python_archive, tmp_path, case):
    make_member, message = MALICIOUS_MEMBERS[case]
    member = make_member()
    # The hostile member comes first, after one harmless file, inside an otherwise valid layout.
    members = [_file_member(f"{PY_DIR}/readme.html", b"hi"), member]
    members += [
        _file_member(name, data)
        for name, data in _fixture_members(python_archive).items()
        if not name.endswith("readme.html")
    ]
    archive_path = _write_archive(tmp_path / "evil.tar.gz", members)
    with pytest.raises(UnsafeArchiveError, match=message) as error:
        safe_extract(archive_path, tmp_path / "out")
    assert repr(member[0].name) in str(error.value)  # The message names the member.
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "evil").exists() and not Path("/tmp/cifar-test-evil").exists()
    assert sorted(os.listdir(tmp_path)) == ["evil.tar.gz"]
    with pytest.raises(UnsafeArchiveError, match=message):
        read_archive(archive_path)


def test_an_oversized_member_is_rejected_before_its_bytes_are_read(tmp_path):
    info = tarfile.TarInfo(f"{PY_DIR}/data_batch_1")
    info.size = archive_module.MAX_MEMBER_BYTES + 1
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.addfile(info)  # A header claiming 512 MiB + 1 with no data behind it.
    path = tmp_path / "bomb.tar"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(UnsafeArchiveError, match="over the .* byte limit"):
        read_archive(path)


def test_the_total_unpacked_size_is_bounded(python_archive, tmp_path, monkeypatch):
    monkeypatch.setattr(archive_module, "MAX_TOTAL_BYTES", 50_000)
    with pytest.raises(UnsafeArchiveError, match="unpacked bytes"):
        safe_extract(python_archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_duplicated_member_is_rejected(python_archive, tmp_path):
    files = _fixture_members(python_archive)
    name = f"{PY_DIR}/test_batch"
    members = [_file_member(key, data) for key, data in files.items()] + [_file_member(name, b"replacement")]
    with pytest.raises(UnsafeArchiveError, match="more than once"):
        read_archive(_write_archive(tmp_path / "twice.tar.gz", members))


# The restricted unpickler.


class _RunsCommand:
    """A pickle payload that would run a shell command when loaded by a plain unpickler."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_pickle_that_runs_a_command_is_refused_and_does_not_run(python_archive, tmp_path):
    marker = tmp_path / "MARKER"
    payload = _python_batch(_RunsCommand(f"touch {marker}"), [0] * TRAIN_PER_BATCH)
    archive_path = _replaced(python_archive, tmp_path / "exploit.tar.gz", {f"{PY_DIR}/data_batch_3": payload})
    with pytest.raises(UnsafePickleError, match=r"data_batch_3.*(posix|os)\.system"):
        read_archive(archive_path)
    assert not marker.exists()
    # Extraction only writes bytes; reading the extracted folder refuses the pickle just the same.
    extracted = safe_extract(archive_path, tmp_path / "out")
    with pytest.raises(UnsafePickleError):
        read_directory(extracted)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload, message",
    [
        (pickle.dumps(eval), "builtins.eval"),
        (pickle.dumps(np.load), "numpy.load"),
        (pickle.dumps(np.array([1, "x"], dtype=object), protocol=2), "object dtype"),
        (b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x06\x00\x00\x00rot_13\x86R.", "only latin-1"),
    ],
    ids=["builtins.eval", "numpy.load", "object array", "codecs other than latin-1"],
)
def test_the_unpickler_admits_only_numeric_arrays_and_containers(payload, message):
    with pytest.raises(UnsafePickleError, match=message):
        load_pickle(payload, "member")


def test_the_unpickler_reads_numpy_1_and_python_2_style_pickles():
    rows = np.arange(2 * 3072, dtype=np.uint32).astype(np.uint8).reshape(2, 3072)
    modern = pickle.dumps({b"data": rows, b"labels": [1, 2]}, protocol=2)
    # NumPy 1 (and the official archive) name the reconstructor numpy.core.multiarray.
    legacy = modern.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert legacy != modern
    for payload in (modern, legacy):
        loaded = RestrictedUnpickler(io.BytesIO(payload), encoding="bytes").load()
        np.testing.assert_array_equal(loaded[b"data"], rows)
        assert loaded[b"labels"] == [1, 2]


# Found by the fuzz suite (tests/test_fuzz_archives.py, issue 39).


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_batch_pickled_with_any_protocol_is_read_exactly(protocol):
    rows = np.random.default_rng(protocol).integers(0, 256, (3, 3072), dtype=np.uint8)
    for labels in ([1, 2, 3], np.array([1, 2, 3])):  # Protocol 5 rebuilds arrays with numpy's _frombuffer.
        data, read_labels = parse_python_batch(pickle.dumps({b"data": rows, b"labels": labels}, protocol), "batch")
        np.testing.assert_array_equal(data, rows)
        assert read_labels.tolist() == [1, 2, 3]
    empty = pickle.dumps({"data": np.zeros((0, 3072), np.uint8), "labels": []}, protocol)  # bytes() in protocol 2.
    assert parse_python_batch(empty, "batch")[0].shape == (0, 3072)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x80\x05\x96" + (2**40).to_bytes(8, "little") + b".", "bytearray8, but only 1 remain"),  # BYTEARRAY8
        (b"\x80\x02]r" + (2**32 - 1).to_bytes(4, "little") + b".", "memo index 4,294,967,295"),  # LONG_BINPUT
        (b"\x80\x04\x95" + (2**62).to_bytes(8, "little") + b"N.", "runs past the end"),  # FRAME
        (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\x00\x00\x40\x85C\x01b\x87R.",
         "only an empty array"),  # _reconstruct(ndarray, (2**30,), b'b'): a GiB before any state.
    ],
    ids=["bytearray8 of a TiB", "memo index 2**32", "frame of 2**62 bytes", "reconstruct a GiB"],
)  # fmt: skip
def test_a_pickle_that_states_more_than_it_holds_is_refused_before_anything_is_allocated(payload, message):
    with pytest.raises((InvalidDatasetError, UnsafePickleError), match=message):
        load_pickle(payload, "member")


@pytest.mark.filterwarnings("error")
def test_a_pickle_whose_string_makes_python_warn_is_refused_without_a_warning():
    # Found by make fuzz: a protocol-0 string with an invalid escape made the decoder warn (on a terminal, a line).
    with pytest.raises(InvalidDatasetError, match=r"member: not a readable CIFAR pickle: invalid escape sequence"):
        load_pickle(b"S'\\\xc3'\n.", "member")


def test_labels_of_nested_lists_are_refused_before_numpy_expands_them():
    # [[shared] * 1000] * 1000 pickles in kilobytes (memo references) and expands to a million labels and more.
    shared = [0] * 1000
    payload = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [[shared] * 1000] * 1000}, 2)
    with pytest.raises(InvalidDatasetError, match="labels are a list, expected a flat list of integers"):
        parse_python_batch(payload, "data_batch_1")


@pytest.mark.parametrize(
    "members",
    [[("./", None), (".", b"x")], [(f"{PY_DIR}", b"x"), (f"{PY_DIR}/", None)], [("a", b"x"), ("a/b", b"y")]],
    ids=["a file named '.'", "a file where a directory is", "a directory where a file is"],
)
def test_members_that_clash_are_refused_and_nothing_is_extracted(tmp_path, members):
    entries = [
        _file_member(name, data) if data is not None else _special_member(name, tarfile.DIRTYPE)
        for name, data in members
    ]
    archive_path = _write_archive(tmp_path / "clash.tar.gz", entries)
    with pytest.raises(UnsafeArchiveError, match="archive's top directory|clashes with another member"):
        safe_extract(archive_path, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["clash.tar.gz"]


# Malformed contents.


@pytest.mark.parametrize(
    "data, labels, message",
    [
        (np.zeros((TRAIN_PER_BATCH, 3000), np.uint8), [0] * TRAIN_PER_BATCH, r"shape \(100, 3000\)"),
        (np.zeros((TRAIN_PER_BATCH, 3072), np.float32), [0] * TRAIN_PER_BATCH, "dtype float32"),
        (np.zeros((TRAIN_PER_BATCH, 3072), np.uint8), [0] * (TRAIN_PER_BATCH - 1), "99 labels for 100 images"),
        (np.zeros((TRAIN_PER_BATCH, 3072), np.uint8), [0] * 99 + [10], r"outside 0..9.*index 99 \(value 10\)"),
        (np.zeros((TRAIN_PER_BATCH, 3072), np.uint8), [-1] + [0] * 99, r"outside 0..9"),
        ([[0] * 3072] * TRAIN_PER_BATCH, [0] * TRAIN_PER_BATCH, "expected a numpy array"),
    ],
    ids=["wrong row size", "wrong dtype", "label count", "label too large", "negative label", "not an array"],
)
def test_malformed_python_batches_are_rejected_naming_the_batch(python_archive, tmp_path, data, labels, message):
    archive_path = _replaced(
        python_archive, tmp_path / "bad.tar.gz", {f"{PY_DIR}/data_batch_2": _python_batch(data, labels)}
    )
    with pytest.raises(InvalidDatasetError, match=f"data_batch_2: .*{message}"):
        read_archive(archive_path)


def test_a_binary_batch_with_a_partial_record_is_rejected(binary_archive, tmp_path):
    name = f"{BIN_DIR}/test_batch.bin"
    data = _fixture_members(binary_archive)[name]
    archive_path = _replaced(binary_archive, tmp_path / "bad.tar.gz", {name: data[:-5]})
    with pytest.raises(InvalidDatasetError, match="test_batch.bin: .* not a whole number of 3073-byte records"):
        read_archive(archive_path)


def test_a_binary_label_out_of_range_is_rejected(binary_archive, tmp_path):
    name = f"{BIN_DIR}/data_batch_4.bin"
    data = bytearray(_fixture_members(binary_archive)[name])
    data[3073 * 7] = 12  # The label byte of record 7.
    archive_path = _replaced(binary_archive, tmp_path / "bad.tar.gz", {name: bytes(data)})
    with pytest.raises(InvalidDatasetError, match=r"data_batch_4.bin: 1 labels outside 0..9, first at index 7"):
        read_archive(archive_path)


def test_wrong_class_names_are_rejected(binary_archive, tmp_path):
    name = f"{BIN_DIR}/batches.meta.txt"
    archive_path = _replaced(binary_archive, tmp_path / "bad.tar.gz", {name: b"cat\ndog\n"})
    with pytest.raises(InvalidDatasetError, match="batches.meta.txt: 2 class names, expected 10"):
        read_archive(archive_path)


def test_a_missing_batch_is_named(python_archive, tmp_path):
    archive_path = _replaced(python_archive, tmp_path / "bad.tar.gz", {f"{PY_DIR}/data_batch_5": None})
    with pytest.raises(UnknownLayoutError, match="missing data_batch_5 .*expect_official_counts false"):
        read_archive(archive_path)
    # Asked for, an archive with a batch left out (to add later as new data) reads the batches it has.
    assert len(read_archive(archive_path, all_batches=False).train_images) == 4 * TRAIN_PER_BATCH
    without_meta = _replaced(archive_path, tmp_path / "worse.tar.gz", {f"{PY_DIR}/batches.meta": None})
    with pytest.raises(UnknownLayoutError, match="missing batches.meta"):
        read_archive(without_meta, all_batches=False)


def test_an_archive_without_a_cifar_layout_is_rejected(tmp_path):
    archive_path = _write_archive(tmp_path / "other.tar.gz", [_file_member("photos/cat.png", b"png")])
    with pytest.raises(UnknownLayoutError, match="neither official CIFAR-10 layout"):
        read_archive(archive_path)


# Corrupt files.


def test_a_truncated_archive_is_reported_as_corrupt(python_archive, tmp_path):
    data = Path(python_archive).read_bytes()
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptArchiveError, match="archive is truncated or corrupt"):
        read_archive(truncated)
    with pytest.raises(CorruptArchiveError, match="archive is truncated or corrupt"):
        safe_extract(truncated, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["truncated.tar.gz"]


def test_a_file_that_is_not_an_archive_is_reported_as_corrupt(tmp_path):
    path = tmp_path / "noise.tar.gz"
    path.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 8)  # A gzip magic number, then garbage.
    with pytest.raises(CorruptArchiveError, match="archive is truncated or corrupt"):
        read_archive(path)


def test_the_standard_library_gzip_path_reads_the_same_and_reports_truncation(python_archive, tmp_path, monkeypatch):
    with_isal = read_archive(python_archive)
    monkeypatch.setattr(archive_module, "igzip", None)
    without_isal = read_archive(python_archive)
    np.testing.assert_array_equal(without_isal.train_images, with_isal.train_images)
    data = Path(python_archive).read_bytes()
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptArchiveError, match="archive is truncated or corrupt"):
        read_archive(truncated)


def test_an_archive_with_too_many_members_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(archive_module, "MAX_MEMBERS", 3)
    members = [_file_member(f"{PY_DIR}/extra_{index}", b"x") for index in range(5)]
    with pytest.raises(UnsafeArchiveError, match="more than 3 members"):
        read_archive(_write_archive(tmp_path / "many.tar.gz", members))
