"""What the data validation gate costs on the real archive, and what it finds there.

    python bench/data_gate.py [ARCHIVE] [--repeats 3] [--write-docs]

What it measures: METHOD below, which also opens its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tarfile
import time
from pathlib import Path

import common

from cifar.config import make_config
from cifar.data.download import fetch_archive
from cifar.data.gate import check_prepared
from cifar.data.ingest import ingest_addition
from cifar.data.manifest import load_manifest
from cifar.data.prepare import prepare_data
from cifar.io import file_digests
from cifar.results import ArchiveInfo

HEADING = "## Data validation gate"
# What is measured, the opening of its section of docs/BENCHMARKS.md.
METHOD = """\
Side by side in one run, interleaved, in fresh workdirs (wall seconds, median):

- the data stage on the 50,000-image archive with the archive's analysis already kept (what every data
  stage after the first costs: conversion, the plan, the statistics) against the same stage computing the
  analysis (hashes, drift features, near-duplicates of the test images; the first data stage of an
  archive), and the gate itself on that snapshot (no new data: every check runs on nothing);
- a 10,000-image addition: the archive rebuilt without data_batch_5, then that batch ingested
  (`cifar.data.ingest.ingest_addition`: read, plan, gate, store), the new snapshot's data stage, and the
  gate on it in the data stage (`check_prepared`).

It also reports how many test images have a near-duplicate in the training batches (the contact
sheet is the data directory's near_duplicates.png) and what the gate says about the real batch.
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", nargs="?", default=str(common.DEFAULT_ARCHIVE))
    parser.add_argument("--workdir", default=str(common.DEFAULT_BENCH_WORKDIR / "data-gate"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--note", default=None, help="A note on the machine's state, added to the docs.")
    return parser.parse_args(argv)


def info(path: Path, source: str | None = None) -> ArchiveInfo:
    digests = file_digests(path)
    return ArchiveInfo(path=str(path), sha256=digests["sha256"], md5=digests["md5"], source=source or str(path))


def without_last_batch(archive: Path, target: Path) -> tuple[Path, Path]:
    """The archive without data_batch_5 (an archive of 40,000 training images) and that batch as a file."""
    files = {}
    with tarfile.open(archive) as source:
        for member in source.getmembers():
            if member.isfile():
                files[member.name] = source.extractfile(member).read()
    batch_name = next(name for name in files if name.endswith("data_batch_5"))
    batch = target.parent / "data_batch_5"
    batch.write_bytes(files.pop(batch_name))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    target.write_bytes(buffer.getvalue())
    return target, batch


def timed(function, *args) -> tuple[float, object]:
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def measure(args) -> tuple[dict[str, list[float]], dict]:
    """The timed runs (`args.repeats` of each, interleaved) in fresh workdirs: seconds per measurement, and facts."""
    root = Path(args.workdir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    archive = fetch_archive(args.archive, root / "downloads", sha256=common.default_sha256(Path(args.archive)))
    config = make_config("default", {"data": {"source": archive.path, "sha256": archive.sha256}})
    base40, batch_file = without_last_batch(Path(archive.path), root / "base40k.tar.gz")
    config40 = make_config(
        "default", {"data": {"source": str(base40), "expect_official_counts": False, "validation_size": 4000}}
    )
    archive40 = info(base40)
    times: dict[str, list[float]] = {name: [] for name in (
        "stage_kept", "stage_cold", "gate_base", "ingest", "stage_addition", "gate_addition")}  # fmt: skip
    # The analysis kept from a first run, copied into fresh workdirs for the "kept" variant.
    warm = root / "warm"
    prepare_data(config.data, warm, archive)
    facts: dict = {}
    for repeat in range(args.repeats):
        order = ("kept", "cold") if repeat % 2 == 0 else ("cold", "kept")
        for variant in order:
            workdir = root / f"{variant}-{repeat}"
            if variant == "kept":
                shutil.copytree(warm / "data" / "bases", workdir / "data" / "bases")
            seconds, data = timed(prepare_data, config.data, workdir, archive)
            times[f"stage_{variant}"].append(seconds)
            if variant == "kept":
                seconds, _ = timed(check_prepared, config, data.data_dir, archive.path, workdir, None)
                times["gate_base"].append(seconds)
                facts["near_duplicates"] = load_manifest(data.data_dir).near_duplicate_test_images
                facts["sheet"] = str(Path(data.data_dir) / "near_duplicates.png")
        measure_addition(config40, batch_file, root / f"addition-{repeat}", archive40, times, facts)
    return times, facts


def measure_addition(
    config40, batch_file: Path, workdir: Path, archive40: ArchiveInfo, times: dict, facts: dict
) -> None:
    """The 10,000-image addition: data_batch_5 ingested into the 40,000-image archive, its data stage, the gate."""
    before = prepare_data(config40.data, workdir, archive40)
    seconds, (result, _) = timed(ingest_addition, config40, batch_file, workdir, archive40, None)
    times["ingest"].append(seconds)
    again, _ = ingest_addition(config40, batch_file, workdir, archive40, None)  # The same batch again.
    facts["snapshots"] = (result.previous, result.snapshot, again.changed, again.snapshot)
    seconds, data = timed(prepare_data, config40.data, workdir, archive40)
    times["stage_addition"].append(seconds)
    seconds, (gate_report, _) = timed(check_prepared, config40, data.data_dir, archive40.path, workdir, None)
    times["gate_addition"].append(seconds)
    facts["addition"] = {check.name: (check.value, check.summary) for check in gate_report.checks}
    old_test, new_test = (load_manifest(path).splits["test"] for path in (before.data_dir, data.data_dir))
    facts["test_identical"] = old_test == new_test and old_test.shards[0].sha256 == new_test.shards[0].sha256
    facts["addition_passed"] = gate_report.passed


def docs_body(args, argv, load_at_start: str, times: dict[str, list[float]], facts: dict) -> str:
    """The section of docs/BENCHMARKS.md: the method, the table, the gate's share and its findings."""
    medians = {name: common.median(values) for name, values in times.items()}
    machine = common.machine_description(load_at_start, tensorflow=False)
    lines = [
        METHOD.strip(),
        "",
        f"Command: `{common.command_line('bench/data_gate.py', argv)}`",
        "",
        f"Machine: {machine}. Note: {args.note or common.SHARED_NOTE}.",
        "",
        "| measurement | median wall s | runs, wall s | vs the data stage with the analysis kept |",
        "|---|---:|---|---:|",
    ]
    labels = {
        "stage_kept": "data stage, 50,000 images, the archive's analysis kept",
        "stage_cold": "data stage, 50,000 images, computing the archive's analysis (its first data stage)",
        "gate_base": "the gate on that snapshot (no new data)",
        "ingest": "ingest data_batch_5 (10,000 images): read, plan, gate, store",
        "stage_addition": "data stage of the new snapshot (40,000 + 10,000 images)",
        "gate_addition": "the gate on the new snapshot in the data stage (10,000 new images)",
    }
    for name, label in labels.items():
        runs = ", ".join(f"{value:.2f}" for value in times[name])
        lines.append(f"| {label} | {medians[name]:.2f} | {runs} | {medians[name] / medians['stage_kept']:.2f}x |")
    lines += [
        "",
        f"The gate adds {100 * medians['gate_base'] / medians['stage_kept']:.1f} % to the data stage on the archive "
        f"alone and {100 * medians['gate_addition'] / medians['stage_addition']:.1f} % with a 10,000-image addition; "
        f"the archive's analysis (once per archive) adds "
        f"{100 * (medians['stage_cold'] / medians['stage_kept'] - 1):.1f} % to its first data stage.",
        "",
        f"Near-duplicates: {facts['near_duplicates']:,} of 10,000 test images have one in the training batches "
        f"(contact sheet: `{facts['sheet']}`, copied to docs/images/near-duplicates-real.png).",
        "",
        f"The real data_batch_5 as an addition: the gate {'passes' if facts['addition_passed'] else 'fails'}:",
        "",
    ]
    lines += [f"- {name}: {summary}" for name, (_, summary) in facts["addition"].items()]
    previous, snapshot, changed_again, snapshot_again = facts["snapshots"]
    lines += [
        "",
        f"Snapshot {previous} (the 40,000-image archive) became {snapshot}; the test split's shards of both are "
        f"{'byte-identical (same SHA-256s)' if facts['test_identical'] else 'DIFFERENT'}; ingesting the batch "
        f"again {'changed the snapshot' if changed_again else 'changed nothing'} (latest: {snapshot_again}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    times, facts = measure(args)
    body = docs_body(args, argv, load_at_start, times, facts)
    print(body)
    shutil.copyfile(facts["sheet"], common.REPO_ROOT / "docs" / "images" / "near-duplicates-real.png")
    if args.write_docs:
        common.write_section(HEADING, body)


if __name__ == "__main__":
    main()
