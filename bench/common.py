"""Helpers shared by the bench scripts: the machine description, the real archive, statistics and the
section-replacing writer for docs/BENCHMARKS.md.

`write_section` replaces a regex match from the section's `## ` heading up to the next `## ` heading
or the end: a re-run of a script replaces only its own section and keeps every other one.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS_PATH = REPO_ROOT / "docs" / "BENCHMARKS.md"
DEFAULT_ARCHIVE = REPO_ROOT.parent / "shared" / "data" / "cifar-10-python.tar.gz"
# The offline archive's own SHA-256 (it is not the official file, so the official MD5 does not apply).
DEFAULT_SHA256 = "489922dd9a4a6edc25e4029413c0bdbad3f28e7940960932a326c6c87653312c"
# Beside the shared archive: which images kept their original pixels (the rest went through JPEG q75).
PROVENANCE_FILE = "cifar-10-provenance.npz"
DEFAULT_BENCH_WORKDIR = Path("/tmp/cifar-bench")
SHARED_NOTE = (
    "the machine's 2 cores were shared with other engineers' jobs and tests during the run, so "
    "absolute numbers are noisy; compare the ratios (variants were interleaved in the same rounds)"
)

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from harness.digests import recorded_sha256  # noqa: E402


def cpu_model() -> str:
    """The CPU's name, with its family and model and whether it has bfloat16 math (the machines here all call
    themselves "AMD EPYC" or "Intel Xeon": Zen 3 and Zen 4 differ ~1.9x on our suite)."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    flags = fields.get("flags", "").split()
    math = "avx512_bf16" if "avx512_bf16" in flags else ("AVX-512, no bfloat16" if "avx512f" in flags else "AVX2 only")
    return f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, {math})"


def children_cpu_seconds() -> float:
    """User + system CPU seconds of every child process this one has reaped so far (getrusage); the
    difference around a `subprocess.run` is that command's CPU time, less noisy than its wall time."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> str:
    """The 1/5/15-minute load averages as text ("n/a" where the OS has none)."""
    try:
        return ", ".join(f"{value:.1f}" for value in os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def machine_description(load_at_start: str | None = None, *, tensorflow: bool = True) -> str:
    """`<CPU model>, N cores, CPU only|k GPU(s); load average (1/5/15 min) at the start: ...; versions`."""
    parts = [cpu_model(), f"{cores()} cores"]
    versions = [f"Python {platform.python_version()}"]
    if tensorflow:
        import keras
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        parts.append(f"{len(gpus)} GPU(s)" if gpus else "CPU only")
        versions += [f"TF {tf.__version__}", f"Keras {keras.__version__}"]
    text = ", ".join(parts)
    text += f"; load average (1/5/15 min) at the start: {load_at_start or load_average()}"
    return f"{text}; {', '.join(versions)}"


def default_sha256(archive: Path) -> str | None:
    """The digest in `<archive>.sha256` beside the archive, else the offline archive's known one."""
    return recorded_sha256(archive) or (DEFAULT_SHA256 if archive == DEFAULT_ARCHIVE else None)


def prepare_bench_data(
    archive: str | Path = DEFAULT_ARCHIVE, workdir: str | Path = DEFAULT_BENCH_WORKDIR, sha256: str | None = None
) -> Path:
    """The prepared data dir of the real archive in the bench workdir (reused when already there)."""
    from cifar.config import DataConfig
    from cifar.data.prepare import prepare_data

    archive = Path(archive).expanduser().resolve()
    if not archive.is_file():
        raise SystemExit(f"archive not found: {archive}")
    result = prepare_data(DataConfig(source=str(archive), sha256=sha256 or default_sha256(archive)), workdir)
    return Path(result.data_dir)


def exact_test_images(provenance: str | Path):
    """The provenance file's `test_exact` mask: True for each test image with its original pixels."""
    import numpy as np

    with np.load(provenance, allow_pickle=False) as masks:
        return masks["test_exact"].astype(bool)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear-interpolated percentile (fraction in 0..1) of the values."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """`python bench/<script> <args>` as it was run (for the docs)."""
    import shlex

    return shlex.join(["python", f"bench/{script}", *(argv if argv is not None else sys.argv[1:])])


def write_measured_section(
    heading: str,
    description: str,
    script: str,
    argv: Sequence[str] | None,
    load_at_start: str,
    note: str | None,
    table: str,
) -> None:
    """Writes a bench's section: what it measures, the command that repeats it, the machine, then its table."""
    noted = f" Note: {note}." if note else ""
    machine = machine_description(load_at_start)
    body = f"{description}\n\nCommand: `{command_line(script, argv)}`\n\nMachine: {machine}.{noted}\n\n{table}\n"
    write_section(heading, body)
    print(f"wrote {DOCS_PATH}")


SUPERSEDED_HEADING = "## Pilots and superseded sittings"  # docs/BENCHMARKS.md's last section.


def write_section(heading: str, body: str, path: Path = DOCS_PATH) -> None:
    """Replaces (or appends) the `heading` section (`## ...`) of the docs, keeping every other section."""
    if not heading.startswith("## "):
        raise ValueError(f"a section heading starts with '## ', got {heading!r}")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    elif f"\n{SUPERSEDED_HEADING}\n" in text:  # A new section joins today's results, above the old sittings.
        before, after = text.split(f"\n{SUPERSEDED_HEADING}\n", 1)
        text = f"{before.rstrip()}\n\n{section}\n{SUPERSEDED_HEADING}\n{after}"
    else:
        text = text.rstrip() + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
