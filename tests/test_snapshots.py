"""Data snapshots and the validation gate, on small generated archives and additions (no Prefect, no TensorFlow).

Given an archive and an addition (a folder of images, a batch file), expect: what the reader keeps and
what it lists, the snapshot it makes, where each image goes, and which check refuses what, with the
store left as it was.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_EXAMPLES, TRAIN_PER_BATCH
from PIL import Image

from cifar.config import make_config
from cifar.data.additions import MAX_DECODED_PIXELS, NoUsableImagesError, decode_image, read_addition
from cifar.data.archive import UnsafePickleError
from cifar.data.drift import Profile, image_features, js_divergence, linf_distance
from cifar.data.gate_checks import DataValidationError
from cifar.data.ingest import describe_snapshots, ingest_addition, remove_addition
from cifar.data.manifest import load_manifest
from cifar.data.neardup import find_near_duplicates
from cifar.data.plan import goes_to_validation
from cifar.data.prepare import prepare_data
from cifar.data.snapshots import DataStore
from cifar.data.synthetic import CLASS_NAMES, make_split, source_arrays, write_batch_file, write_image_folder
from cifar.io import file_digests
from cifar.results import ArchiveInfo
from cifar.reuse import snapshot_key


def config_for(archive: str, **validate):
    data = {"source": archive, "expect_official_counts": False, "validation_size": 100}
    return make_config("smoke", {"data": data, "validate": validate})


def archive_info(path: str) -> ArchiveInfo:
    digests = file_digests(path)
    return ArchiveInfo(path=str(Path(path).resolve()), sha256=digests["sha256"], md5=digests["md5"], source=path)


def official_test_images(count: int = TEST_EXAMPLES) -> np.ndarray:
    return source_arrays(train_per_batch=TRAIN_PER_BATCH, test_examples=TEST_EXAMPLES)["test"][0][:count]


def store_state(workdir: Path) -> dict[str, str]:
    """Every file of the snapshot store (additions and snapshots) with its digest: what must not change."""
    files = sorted((workdir / "data").glob("additions/**/*")) + sorted((workdir / "data").glob("snapshots/*"))
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in files if path.is_file()}


# Reading additions.


def test_a_folder_keeps_usable_images_and_lists_every_other_file(tmp_path):
    images, labels = make_split(6, seed=5)
    folder = write_image_folder(tmp_path / "new", images, labels)
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(folder / "cat" / "small.png")
    (folder / "zebra").mkdir()
    Image.fromarray(images[0]).save(folder / "zebra" / "stripes.png")
    png = io.BytesIO()
    Image.fromarray(images[1]).save(png, format="PNG")
    (folder / "dog" / "cut.png").write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    (folder / "dog" / "notes.txt").write_text("not an image")
    Image.fromarray(images[2][..., 0]).save(folder / "dog" / "grey.png")
    Image.fromarray(images[3]).convert("RGBA").save(folder / "dog" / "opaque.png")  # Opaque RGBA: usable.
    Image.fromarray(images[4]).save(folder / "loose.png")
    (folder / "dog" / "link.png").symlink_to(folder / "dog" / "opaque.png")

    addition = read_addition(folder, list(CLASS_NAMES))

    assert addition.images.shape == (7, 32, 32, 3) and addition.images.dtype == np.uint8
    assert "dog/opaque.png" in addition.names
    problems = {problem.file: problem.problem for problem in addition.problems}
    assert problems == {
        "cat/small.png": "size",
        "zebra/stripes.png": "unknown_class",
        "dog/cut.png": "truncated",
        "dog/notes.txt": "undecodable",
        "dog/grey.png": "mode",
        "loose.png": "not_in_class_folder",
        "dog/link.png": "link",
    }
    # A declared resize takes the 28x28 image, and the addition records how.
    resized = read_addition(folder, list(CLASS_NAMES), resize="bilinear")
    assert "cat/small.png" in resized.names and resized.resize == "bilinear"


def test_the_same_content_is_the_same_addition_and_batch_files_are_unpickled_safely(tmp_path):
    images, labels = make_split(20, seed=6)
    first = read_addition(write_image_folder(tmp_path / "a", images, labels), list(CLASS_NAMES))
    second = read_addition(write_image_folder(tmp_path / "b", images, labels), list(CLASS_NAMES))
    assert first.digest == second.digest
    batch = read_addition(write_batch_file(tmp_path / "batch", images, labels), list(CLASS_NAMES))
    np.testing.assert_array_equal(batch.images, images)
    assert batch.names[3] == "batch#3" and batch.kind == "batch_file"

    class RunsCommand:
        def __reduce__(self):
            return (print, ("this pickle runs code",))

    hostile = tmp_path / "hostile"
    hostile.write_bytes(__import__("pickle").dumps({"data": RunsCommand(), "labels": [0]}))
    with pytest.raises(UnsafePickleError, match="builtins.print"):
        read_addition(hostile, list(CLASS_NAMES))


# Found by the fuzz suite (tests/test_fuzz_additions.py, issue 39).


def declaring(image_format: str, width: int, height: int) -> bytes:
    """A real 32x32 image file whose header declares `width` x `height` (its pixel data left as it was)."""
    from fuzz_strategies import with_declared_dimensions

    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(buffer, format=image_format)
    return with_declared_dimensions(buffer.getvalue(), image_format, width, height)


@pytest.mark.parametrize("image_format", ["PNG", "JPEG"])
def test_an_image_declaring_other_dimensions_is_refused_from_its_header_not_decoded(tmp_path, image_format):
    # A 236 KB PNG of 9000x9000 pixels took 310 MB and a second to refuse: it was decoded before its size was read.
    # These files hold 32x32 pixels: decoded as 9000x9000 they would be `truncated`, not `size`.
    path = tmp_path / "big"
    path.write_bytes(declaring(image_format, 9000, 9000))
    assert decode_image(path, None) == (
        None,
        ("size", "9000x9000 pixels, expected 32x32 (or opt into a declared resize)"),
    )
    kind, detail = decode_image(path, "bilinear")[1]
    assert kind == "size" and f"over the {MAX_DECODED_PIXELS:,} pixels" in detail  # 81 M pixels: too many to decode.


def test_a_file_name_with_a_newline_is_shown_escaped_on_the_one_line(tmp_path):
    folder = tmp_path / "new"
    (folder / "dragon").mkdir(parents=True)
    (folder / "dragon" / "a\nb.png").write_bytes(b"not an image")
    with pytest.raises(NoUsableImagesError) as raised:
        read_addition(folder, list(CLASS_NAMES))
    assert str(raised.value) == (
        f"no usable image in {folder}: 1 file left out: dragon/a\\nb.png (unknown_class: folder 'dragon' is not a "
        f"class name ({', '.join(CLASS_NAMES)}))"
    )
    assert raised.value.problems[0].file == "dragon/a\nb.png"  # The record keeps the name as it is.


# Measures and fingerprints.


def test_drift_measures_on_known_histograms():
    assert js_divergence([5, 5, 0], [5, 5, 0]) == 0.0
    assert js_divergence([10, 0], [0, 10]) == pytest.approx(1.0)
    assert js_divergence([1, 1], [1, 3]) == pytest.approx(0.0488, abs=1e-4)
    assert linf_distance([8, 2, 0], [1, 1, 0]) == pytest.approx(0.3)
    images = official_test_images(50)
    half = Profile.of(image_features(images[:25])) + Profile.of(image_features(images[25:]))
    assert half == Profile.of(image_features(images))  # Profiles of parts add up to the whole's.


def test_image_features_of_images_worked_by_hand(monkeypatch):
    plain = np.broadcast_to(np.array([10, 20, 30], np.uint8), (1, 32, 32, 3))
    halves = np.zeros((1, 4, 6, 3), np.uint8)
    halves[:, :2] = 255  # Top half white, bottom half black: luma 255 and 0, its spread 127.5.
    for name, images, expected in [
        ("plain", plain, {"brightness": 0.299 * 10 + 0.587 * 20 + 0.114 * 30, "contrast": 0.0,
                          "mean_red": 10, "mean_green": 20, "mean_blue": 30}),
        ("halves", halves, {"brightness": 127.5, "contrast": 127.5, "mean_red": 127.5, "mean_green": 127.5,
                            "mean_blue": 127.5}),
    ]:  # fmt: skip
        features = image_features(np.ascontiguousarray(images))
        assert {key: float(values[0]) for key, values in features.items()} == pytest.approx(expected, abs=1e-3), name
    many = official_test_images(50)
    whole = image_features(many)
    monkeypatch.setattr("cifar.data.drift.CHUNK_IMAGES", 16)  # Chunks give each image its own features.
    chunked = image_features(many)
    assert all(np.array_equal(whole[name], chunked[name]) for name in whole)


def test_near_duplicates_survive_shifts_crops_colour_and_jpeg_but_different_images_do_not_match():
    originals = official_test_images(40)
    padded = np.pad(originals, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
    shifted = padded[:, :32, 2:34]  # One pixel down and one to the left.
    cropped = np.stack([np.asarray(Image.fromarray(im[2:30, 2:30]).resize((32, 32))) for im in originals[:10]])
    coloured = np.clip(originals[:10] * np.array([1.15, 0.95, 0.85]) + 20, 0, 255).astype(np.uint8)
    jpeg = []
    for image in originals[:10]:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=50)
        jpeg.append(np.asarray(Image.open(buffer)))
    queries = np.concatenate([shifted[:10], cropped, coloured, np.stack(jpeg), originals[30:40]])
    found = find_near_duplicates(queries, originals[:30], 0.97)
    pairs = dict(zip(found.query, found.pool))
    # Each perturbed copy finds its original (queries 0-39 are copies of pool images 0-9, ten of each kind);
    # the 10 images the pool lacks (queries 40-49) find nothing.
    expected = {query: query % 10 for query in range(40)} | {query: None for query in range(40, 50)}
    assert {query: pairs.get(query) for query in range(50)} == expected


# Ingesting: the gate refuses what it should, names the files, and leaves the store as it was.


@pytest.fixture
def base_workdir(python_archive, tmp_path):
    """A workdir whose data stage has run once on the archive: the base snapshot is recorded."""
    workdir = tmp_path / "workdir"
    prepare_data(config_for(python_archive).data, workdir, archive_info(python_archive))
    return workdir


def refused(config, path, workdir, archive, **options) -> DataValidationError:
    before = store_state(workdir)
    with pytest.raises(DataValidationError) as raised:
        ingest_addition(config, path, workdir, archive, None, **options)
    assert store_state(workdir) == before  # Nothing written to the snapshot store.
    report = json.loads(Path(raised.value.report_path).read_text())
    assert "rejected" in raised.value.report_path and not report["passed"]
    return raised.value


@pytest.mark.parametrize(
    ("damage", "check", "named"),
    [
        ("small", "schema", "cat/small.png (size)"),
        ("unknown_class", "schema", "zebra/00000.png (unknown_class)"),
        ("truncated", "schema", "dog/cut.png (truncated)"),
        ("one_class", "label_distribution", "class 3: 8"),
    ],
)
def test_a_bad_addition_is_refused_with_one_line_naming_the_check_and_files(
    python_archive, base_workdir, tmp_path, damage, check, named
):
    images, labels = make_split(250, seed=11)
    if damage == "one_class":
        labels = np.where(np.arange(250) < 200, 3, labels)  # 80 % cats.
    folder = write_image_folder(tmp_path / "new", images, labels)
    if damage == "small":
        Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(folder / "cat" / "small.png")
    elif damage == "unknown_class":
        (folder / "zebra").mkdir()
        Image.fromarray(images[0]).save(folder / "zebra" / "00000.png")
    elif damage == "truncated":
        source = next((folder / "dog").iterdir()).read_bytes()
        (folder / "dog" / "cut.png").write_bytes(source[: len(source) // 2])

    error = refused(config_for(python_archive), folder, base_workdir, archive_info(python_archive))

    message = str(error)
    assert message.startswith("data validation failed: ") and "\n" not in message
    assert f"{check}:" in message and named in message
    assert [item.name for item in error.report.failed()] == [check]
    # The same addition, not enforced: recorded, and the report says what failed.
    config = config_for(python_archive, enforce=False)
    result, report = ingest_addition(config, folder, base_workdir, archive_info(python_archive), None)
    assert result.changed and not result.passed and [item.name for item in report.failed()] == [check]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("empty", "the folder holds no files"),
        ("misspelt_class", "1 file left out: dragon/a.png (unknown_class: folder 'dragon' is not a class name"),
        ("text_only", "2 files left out: cat/notes.txt (undecodable: not an image PIL can read); loose.png"),
        ("empty_batch", "the batch file holds no images"),
    ],
)
def test_an_addition_with_no_usable_image_is_refused_naming_each_file_and_nothing_is_stored(
    python_archive, tmp_path, content, message
):
    # Issue 39: these ended in `cannot reshape array of size 0 into shape (0,newaxis)` from the gate.
    path = tmp_path / "new"
    path.mkdir()
    if content == "misspelt_class":
        (path / "dragon").mkdir()
        Image.fromarray(make_split(1, seed=3)[0][0]).save(path / "dragon" / "a.png")
    elif content == "text_only":
        (path / "cat").mkdir()
        (path / "cat" / "notes.txt").write_text("not an image")
        Image.fromarray(make_split(1, seed=3)[0][0]).save(path / "loose.png")
    elif content == "empty_batch":
        path = write_batch_file(tmp_path / "data_batch_6", np.zeros((0, 32, 32, 3), np.uint8), [])
    workdir = tmp_path / "workdir"

    with pytest.raises(NoUsableImagesError) as raised:
        ingest_addition(config_for(python_archive), path, workdir, archive_info(python_archive), None)

    assert str(raised.value).startswith(f"no usable image in {path}: {message}") and "\n" not in str(raised.value)
    assert not (workdir / "data").exists()  # Refused as read: no store, no rejected report, no analysis.


def test_a_shifted_test_image_in_an_addition_is_leakage_kept_out_of_training(python_archive, base_workdir, tmp_path):
    images, labels = make_split(60, seed=12)
    test = official_test_images()
    padded = np.pad(test[7:8], ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
    images[4] = padded[0, 2:34, 1:33]  # Test image 7, one pixel to the left.
    images[9] = test[12]  # An exact copy of test image 12.
    images[15] = images[14]  # A duplicate inside the addition.
    archive = archive_info(python_archive)
    folder = write_image_folder(tmp_path / "new", images, labels)

    result, report = ingest_addition(config_for(python_archive), folder, base_workdir, archive, None)

    assert result.passed and result.changed
    leakage = {item["name"]: item["of"] for item in report.check("leakage").examples}
    assert leakage == {
        f"{CLASS_NAMES[labels[4]]}/00004.png": "test image 7",
        f"{CLASS_NAMES[labels[9]]}/00009.png": "test image 12",
    }
    duplicates = report.check("duplicates").examples
    assert [(item["name"], item["of"].split(" of ")[0]) for item in duplicates] == [
        (f"{CLASS_NAMES[labels[15]]}/00015.png", f"{CLASS_NAMES[labels[14]]}/00014.png")
    ]
    data = prepare_data(config_for(python_archive).data, base_workdir, archive)
    plan = json.loads((Path(data.data_dir) / "plan.json").read_text())["parts"][0]
    names = DataStore(base_workdir).addition(plan["digest"]).names  # In stored (path) order.
    kept = {names[index] for index in plan["train"] + plan["validation"]}
    left_out = {f"{CLASS_NAMES[labels[index]]}/{index:05d}.png" for index in (4, 9, 15)}
    assert kept == set(names) - left_out and len(kept) == 57
    assert data.counts["train"] + data.counts["validation"] == 500 + 57


@pytest.mark.slow
def test_snapshots_are_content_addressed_and_the_splits_stay_put(python_archive, base_workdir, tmp_path):
    archive, config = archive_info(python_archive), config_for(python_archive)
    first_images, first_labels = make_split(120, seed=21)
    second_images, second_labels = make_split(80, seed=22)
    first = write_batch_file(tmp_path / "first", first_images, first_labels)
    second = write_image_folder(tmp_path / "second", second_images, second_labels)
    base = prepare_data(config.data, base_workdir, archive)

    one, _ = ingest_addition(config, first, base_workdir, archive, None)
    with_first = prepare_data(config.data, base_workdir, archive)
    two, _ = ingest_addition(config, second, base_workdir, archive, None)
    with_both = prepare_data(config.data, base_workdir, archive)
    again, report = ingest_addition(config, first, base_workdir, archive, None)  # Already in: nothing to do.

    assert not again.changed and report is None and again.snapshot == two.snapshot
    assert two.snapshot == snapshot_key(archive.sha256, [two.addition, one.addition])  # Order-independent.
    assert len({base.key, with_first.key, with_both.key}) == 3
    # The test split's shards are byte-identical in every snapshot.
    test_shards = [load_manifest(result.data_dir).splits["test"].shards for result in (base, with_first, with_both)]
    assert test_shards[0] == test_shards[1] == test_shards[2]
    # An added image's split follows its content: the first addition's validation images stay validation.
    plans = [json.loads((Path(r.data_dir) / "plan.json").read_text()) for r in (with_first, with_both)]
    first_plan = [next(p for p in plan["parts"] if p["digest"] == one.addition) for plan in plans]
    assert first_plan[0]["validation"] == first_plan[1]["validation"] and first_plan[0]["validation"]
    manifest = load_manifest(with_both.data_dir)
    new_data = manifest.slices["new_data"]
    assert (new_data.split, new_data.start) == ("validation", 100)
    assert new_data.stop - new_data.start == sum(len(part["validation"]) for part in plans[1]["parts"])

    # The same parts in another workdir, ingested in the other order: the same key, the same shard bytes.
    other = tmp_path / "other"
    prepare_data(config.data, other, archive)
    ingest_addition(config, second, other, archive, None)
    ingest_addition(config, first, other, archive, None)
    rebuilt = prepare_data(config.data, other, archive)
    assert rebuilt.key == with_both.key
    assert load_manifest(rebuilt.data_dir).splits == manifest.splits

    listing = describe_snapshots(base_workdir)
    assert f"{two.snapshot} (latest)" in listing and f"added {one.addition}" in listing and "120 images" in listing
    removed = remove_addition(base_workdir, archive, one.addition[:10])
    assert DataStore(base_workdir).latest(archive.sha256).additions == [two.addition]
    assert removed.snapshot == snapshot_key(archive.sha256, [two.addition])


def test_the_data_stage_refuses_a_snapshot_whose_addition_failed_unless_not_enforced(
    python_archive, base_workdir, tmp_path
):
    from cifar.data.gate import check_prepared, enforce_report

    images, labels = make_split(250, seed=31)
    folder = write_image_folder(tmp_path / "new", images, labels)
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(folder / "cat" / "small.png")
    archive = archive_info(python_archive)
    ingest_addition(config_for(python_archive, enforce=False), folder, base_workdir, archive, None)
    data = prepare_data(config_for(python_archive).data, base_workdir, archive)

    report, path = check_prepared(config_for(python_archive), data.data_dir, archive.path, base_workdir, None)
    assert path.parent == Path(data.data_dir) and path.is_file()  # Beside the snapshot's manifest.
    with pytest.raises(DataValidationError, match=r"schema: 1 unusable files: cat/small.png \(size\)"):
        enforce_report(report, path)
    assert report.reference_reason == "the base archive (no champion yet)" and report.new_examples == 250
    metrics = report.metrics()
    assert metrics["data_schema"] == 1 and metrics["data_passed"] == 0 and "data_image_drift_brightness" in metrics
    lenient, _ = check_prepared(
        config_for(python_archive, enforce=False), data.data_dir, archive.path, base_workdir, None
    )
    enforce_report(lenient, path)  # Recorded, not raised.


def test_the_archives_own_test_images_with_training_near_duplicates_are_listed(tmp_path):
    from cifar.data.synthetic import build_archive
    from cifar.evaluate import near_duplicate_test_images

    arrays = source_arrays(train_per_batch=40, test_examples=60)
    archive = build_archive(tmp_path / "a.tar.gz", train_per_batch=40, test_examples=60)
    # The same archive with three test images planted in the training batches: two shifted, one exact.
    train_images = arrays["train"][0].copy()
    test = arrays["test"][0]
    train_images[5] = np.pad(test[2], ((1, 1), (1, 1), (0, 0)), mode="reflect")[2:34, 1:33]
    train_images[77] = np.pad(test[40], ((1, 1), (1, 1), (0, 0)), mode="reflect")[1:33, 0:32]
    train_images[150] = test[51]
    planted = _archive_with_training_images(archive, tmp_path / "planted.tar.gz", train_images, per_batch=40)
    config = make_config("smoke", {"data": {"source": str(planted), "expect_official_counts": False,
                                            "validation_size": 20}})  # fmt: skip
    result = prepare_data(config.data, tmp_path / "workdir", archive_info(str(planted)))
    manifest = load_manifest(result.data_dir)
    assert near_duplicate_test_images(result.data_dir, manifest).tolist() == [2, 40, 51]
    assert manifest.near_duplicate_test_images == 3
    assert (Path(result.data_dir) / "near_duplicates.png").read_bytes().startswith(b"\x89PNG")


def _archive_with_training_images(archive: Path, target: Path, train_images: np.ndarray, per_batch: int) -> Path:
    """`archive` with its training batches' pixels replaced by `train_images` (labels kept)."""
    import tarfile

    from cifar.data.archive import read_archive
    from cifar.data.synthetic import _write_gzip_tar

    labels = read_archive(archive).train_labels
    files = {}
    with tarfile.open(archive) as source:
        for member in source.getmembers():
            if member.isfile():
                files[member.name] = source.extractfile(member).read()
    for batch in range(5):
        part = slice(batch * per_batch, (batch + 1) * per_batch)
        batch_file = write_batch_file(target.parent / f"batch-{batch}", train_images[part], labels[part])
        files[f"cifar-10-batches-py/data_batch_{batch + 1}"] = batch_file.read_bytes()
    return _write_gzip_tar(target, files)


def test_the_split_rule_reads_the_hash_as_a_fraction():
    hashes = np.array([0, 2**63, 2**64 - 1], np.uint64)
    assert goes_to_validation(hashes, 0.1).tolist() == [True, False, False]
    assert goes_to_validation(hashes, 0.0).tolist() == [False, False, False]


@pytest.mark.slow
def test_an_ingest_killed_between_storing_and_recording_is_finished_by_the_next(python_archive, base_workdir, tmp_path):
    import signal
    import subprocess
    import sys

    images, labels = make_split(30, seed=41)
    folder = write_image_folder(tmp_path / "new", images, labels)
    script = (
        "import sys; from cifar.config import make_config; from cifar.data.ingest import ingest_addition; "
        "from test_snapshots import archive_info; "
        "config = make_config('smoke', {'data': {'source': sys.argv[1], 'expect_official_counts': False, "
        "'validation_size': 100}}); "
        "print(ingest_addition(config, sys.argv[2], sys.argv[3], archive_info(sys.argv[1]), None)[0].summary)"
    )
    command = [sys.executable, "-c", script, python_archive, str(folder), str(base_workdir)]
    environment = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parent)}
    killed = subprocess.run(command, env={**environment, "CIFAR_KILL_AT": "ingest.stored"}, capture_output=True,
                            text=True, timeout=300, start_new_session=True)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    store = DataStore(base_workdir)
    digest = read_addition(folder, list(CLASS_NAMES)).digest
    assert store.has_addition(digest) and digest not in store.latest(archive_info(python_archive).sha256).additions

    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0 and "added 30 images" in finished.stdout, finished.stderr[-2000:]
    assert store.latest(archive_info(python_archive).sha256).additions == [digest]
