"""Process start-up: what importing TensorFlow costs each process, as shipped and with Keras's unused imports refused;
and what importing the flows costs a process that never draws nor compares histograms.

    .venv/bin/python bench/startup.py --write-docs

Every pipeline, flow run, worker and search trial is a fresh process that imports TensorFlow. Keras imports
scikit-learn and matplotlib.pyplot for features no stage uses; `import cifar` refuses those two to Keras
(cifar/_keras_imports.py). The variants run interleaved, each in a fresh interpreter:
  - baseline: `import tensorflow` (the finder not installed: Keras imports as shipped);
  - ours:     `import cifar, tensorflow` (the finder installed first, as in every process of ours);
  - empty:    `pass` (the interpreter alone);
  - flows-baseline: `import flows.pipeline` after matplotlib's Agg canvas, scipy.spatial and MLflow's pyfunc,
    which the flows imported with cifar.plots, cifar.data.drift and cifar.serving_model until each was imported
    where it is used;
  - flows:    `import flows.pipeline` (what every flow run, `prefect deploy`, `flows/promote.py`, a dry run
    and a resumed run import before their first stage).
CPU seconds are user + system time of the child (getrusage), less sensitive than wall time to other load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SECTION = "## Process start-up"
# What the flows' imports pulled in before each was left to the stage that uses it: matplotlib's Agg canvas and
# scipy.spatial (cifar.plots, cifar.data.drift), then MLflow (the serving model's module, via cifar.registry).
FLOWS_BEFORE = (
    "import matplotlib.figure, matplotlib.backends.backend_agg, scipy.spatial.distance, mlflow.models, mlflow.pyfunc; "
)
VARIANTS = {
    "baseline": "import tensorflow",
    "ours": "import cifar, tensorflow",
    "empty": "pass",
    "flows-baseline": FLOWS_BEFORE + "import flows.pipeline",
    "flows": "import flows.pipeline",
}
BASELINE_OF = {"ours": "baseline", "flows": "flows-baseline", "flows-baseline": "flows-baseline"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="Fresh processes per variant (interleaved).")
    parser.add_argument("--write-docs", action="store_true", help=f"Replace docs/BENCHMARKS.md's {SECTION!r}.")
    parser.add_argument("--note", default=None, help="A note on the machine's state, printed with the figures.")
    return parser.parse_args(argv)


def timed(code: str) -> tuple[float, float]:
    """Wall and CPU seconds of a fresh interpreter running `code` (imports as a pipeline process makes them)."""
    before, started = common.children_cpu_seconds(), time.perf_counter()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run([sys.executable, "-c", code], cwd=common.REPO_ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - started, common.children_cpu_seconds() - before


def measure(repeats: int) -> dict[str, dict[str, list[float]]]:
    results = {name: {"wall": [], "cpu": []} for name in VARIANTS}
    for repeat in range(repeats):
        order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))  # Drift hits both alike.
        for name in order:
            wall, cpu = timed(VARIANTS[name])
            results[name]["wall"].append(wall)
            results[name]["cpu"].append(cpu)
        print(f"round {repeat + 1}/{repeats}: " + ", ".join(f"{n} {results[n]['cpu'][-1]:.2f} CPU-s" for n in order))
    return results


def table(results: dict[str, dict[str, list[float]]]) -> str:
    empty_cpu = common.median(results["empty"]["cpu"])
    rows = [
        "| variant | code | median wall s | median CPU s | CPU s beyond the interpreter | vs its baseline |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, code in VARIANTS.items():
        cpu, wall = common.median(results[name]["cpu"]), common.median(results[name]["wall"])
        beyond = cpu - empty_cpu
        baseline = BASELINE_OF.get(name, "baseline")
        ratio = "-" if name == "empty" else f"{beyond / (common.median(results[baseline]['cpu']) - empty_cpu):.2f}x"
        rows.append(f"| {name} | `{code}` | {wall:.2f} | {cpu:.2f} | {beyond:.2f} | {ratio} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_at_start = common.load_average()
    results = measure(args.repeats)
    text = table(results)
    print(text)
    if args.write_docs:
        description = (
            "What importing TensorFlow costs every fresh process of ours (pipelines, flow runs, "
            "workers, search trials): as shipped, Keras also imports scikit-learn (with scipy.stats) and "
            "matplotlib.pyplot for its sklearn wrappers and image galleries, which no stage uses; `import cifar` "
            "refuses those two imports to Keras alone (cifar/_keras_imports.py). Below them, importing the flows, "
            "which every flow run, `prefect deploy`, `flows/promote.py`, a dry run and a resumed run do before "
            "their first stage: `flows` imports matplotlib and scipy.spatial only where a figure is drawn or "
            "histograms compared, and MLflow only where a stage tracks or registers; `flows-baseline` imports "
            "them first, as the flows' imports did before. Each "
            "variant is a fresh "
            f"interpreter, {args.repeats} of each interleaved (order alternated); CPU s is user + system time "
            "(getrusage)."
        )
        common.write_measured_section(SECTION, description, "startup.py", argv, load_at_start, args.note, text)


if __name__ == "__main__":
    main()
