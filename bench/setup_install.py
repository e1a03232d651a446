"""`make setup`: installing the pinned set into a new venv with uv (ours) against pip (the recipe before).

    .venv/bin/python bench/setup_install.py --write-docs

CI starts every run with `make setup` on a clean clone, before the tests and the stack check can start, so
its time adds to CI's whole. Both variants install the same pins (constraints.txt) and the project
(editable, with the dev and postgres extras) into a new venv in a temporary directory, from warm caches
(pip's and uv's), interleaved:
  - baseline: `python -m venv`, `pip install --upgrade pip`, `pip install -c constraints.txt -e '.[dev,postgres]'`
    (the Makefile's recipe before; pip compiles the bytecode as it installs);
  - ours:     `make setup VENV=...` (uv, pinned in constraints.txt, with `--compile-bytecode`).
Each venv is checked to hold the same packages (`pip freeze`, uv itself aside) and then deleted.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SECTION = "## Setup: installing the pinned set"
PACKAGES = "-e .[dev,postgres]"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="New venvs per variant (interleaved).")
    parser.add_argument("--write-docs", action="store_true", help=f"Replace docs/BENCHMARKS.md's {SECTION!r}.")
    parser.add_argument("--note", default=None, help="A note on the machine's state, printed with the figures.")
    return parser.parse_args(argv)


def install(variant: str, venv: Path) -> None:
    def run(*command: str) -> None:
        subprocess.run(command, cwd=common.REPO_ROOT, check=True, capture_output=True, timeout=1800)

    if variant == "ours":
        run("make", "--no-print-directory", "setup", f"VENV={venv}")
        return
    python = str(venv / "bin" / "python")
    run(shutil.which("python3") or sys.executable, "-m", "venv", str(venv))  # As the Makefile: PYTHON ?= python3.
    run(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(python, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[dev,postgres]")


def frozen(venv: Path) -> list[str]:
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    return sorted(line for line in listed if not line.startswith(("uv==", "pip==")))


def measure(repeats: int) -> tuple[dict[str, dict[str, list[float]]], bool]:
    results = {name: {"wall": [], "cpu": []} for name in ("baseline", "ours")}
    packages: dict[str, list[str]] = {}
    for repeat in range(repeats):
        order = ["baseline", "ours"] if repeat % 2 == 0 else ["ours", "baseline"]  # Drift hits both alike.
        for name in order:
            scratch = Path(tempfile.mkdtemp(prefix=f"setup-{name}-"))
            try:
                before, started = common.children_cpu_seconds(), time.perf_counter()
                install(name, scratch / ".venv")
                results[name]["wall"].append(time.perf_counter() - started)
                results[name]["cpu"].append(common.children_cpu_seconds() - before)
                packages[name] = frozen(scratch / ".venv")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        print(f"round {repeat + 1}/{repeats}: " + ", ".join(f"{n} {results[n]['wall'][-1]:.1f} s" for n in order))
    return results, packages["baseline"] == packages["ours"]


def table(results: dict[str, dict[str, list[float]]], same: bool) -> str:
    base_wall = common.median(results["baseline"]["wall"])
    rows = ["| variant | median wall s | median CPU s | wall vs baseline |", "|---|---:|---:|---:|"]
    for name, measured in results.items():
        wall, cpu = common.median(measured["wall"]), common.median(measured["cpu"])
        rows.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {wall / base_wall:.2f}x |")
    rows.append("")
    rows.append(f"Same packages and versions in both venvs (`pip freeze`): {'yes' if same else 'NO'}.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    results, same = measure(args.repeats)
    text = table(results, same)
    print(text)
    if args.write_docs:
        description = (
            "`make setup` on a clean clone, which CI runs before anything else: a new venv with the pinned set "
            f"and the project (`{PACKAGES}`), from warm caches, the Makefile's recipe before (pip) against "
            f"today's (uv, pip where uv fails); {args.repeats} new venvs of each, interleaved."
        )
        common.write_measured_section(SECTION, description, "setup_install.py", argv, load_at_start, args.note, text)


if __name__ == "__main__":
    main()
