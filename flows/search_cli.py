"""The command line of the `cifar-search` flow: `python flows/search.py [options]` (see `--help`).

The same contract as `python flows/pipeline.py` (flows/cli.py, whose helpers it uses): flags, `--set`
and the search space become one validated request before anything starts (a bad one exits 2 with one
`error:` line naming the field); the search runs in a supervised child that leaves no process
behind; tracebacks go to `WORKDIR/logs/`. With PREFECT_API_URL set, trials go to that server's work
pool; without it, to a temporary local pool with `--parallel` workers (flows/local_pool.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from pydantic import ValidationError

from cifar.config import PRESETS, ConfigOverrides, resolve_workdir
from cifar.preflight import ImpossibleRequestError, check_request
from cifar.search.space import SPACE_PRESETS, load_space
from flows.cli import (
    SUPERVISED_ENV,
    add_archive_arguments,
    config_from_args,
    describe_validation_error,
    log_to_file,
    supervise,
)
from flows.local_pool import local_work_pool
from flows.search import TRIAL_DEPLOYMENT, cifar_search, format_search


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python flows/search.py",
        description="Hyperparameter search over the CIFAR-10 pipeline (Prefect flow `cifar-search`, Optuna).",
        epilog="Example: python flows/search.py --source cifar-10-python.tar.gz --sha256 HEX --preset smoke "
        "--trials 8 --parallel 2",
    )
    add = parser.add_argument
    add_archive_arguments(parser)
    add("--workdir", default="./workdir", help="where data, runs, the study and search-summary.json go")
    add("--preset", default="smoke", choices=sorted(PRESETS), help="the pipeline preset every trial starts from")
    presets = ", ".join(sorted(SPACE_PRESETS))
    add("--space", default="smoke", help=f"search space: a preset ({presets}) or a JSON/YAML file")
    add("--trials", type=int, default=8, help="trials the study should reach (finished ones count after a restart)")
    add("--parallel", type=int, default=2, help="trials at once (without a server: local workers)")
    help_until = "what the best trial gets after the search: train (nothing), evaluate, or export and register"
    add("--until", default="export", choices=("train", "evaluate", "export"), help=help_until)
    add("--storage", help="the study's store: a journal file or a database URL (default: CIFAR_SEARCH_STORAGE, "
        "else WORKDIR/search/<study>.journal)")  # fmt: skip
    add("--deployment", default=TRIAL_DEPLOYMENT, help="the `cifar` deployment trials run as (with a server)")
    help_set = "override one config field of every trial, e.g. --set train.steps_per_epoch=20 (repeatable)"
    add("--set", action="append", metavar="SECTION.FIELD=VALUE", help=help_set)
    parser.set_defaults(fresh=False)  # flows/cli.config_from_args reads it; a search never discards runs.
    return parser


def check_request_args(args: argparse.Namespace):
    """The validated config and space of a command line; raises ValueError naming the bad field."""
    if args.trials < 1 or args.parallel < 1:
        raise ValueError(f"--trials and --parallel must be at least 1, got {args.trials} and {args.parallel}")
    config = config_from_args(args)
    check_request(config)
    try:
        space = load_space(args.space)
    except ValidationError as error:
        message = describe_validation_error(error).replace("invalid configuration: ", "invalid space: ")
        raise ValueError(message) from None
    space.check_against(config)
    return config, space


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, space = check_request_args(args)
        workdir = resolve_workdir(args.workdir)
    except (ValueError, ImpossibleRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2  # Before any work: nothing was started or written.
    if os.environ.get(SUPERVISED_ENV) != "1" and sys.platform == "linux":
        return supervise(sys.argv[1:] if argv is None else list(argv), script="search.py")
    log_path = log_to_file(workdir, name="search")
    arguments = {
        "config": ConfigOverrides.of(config),
        "space": args.space if args.space in SPACE_PRESETS else str(os.path.abspath(args.space)),
        "trials": args.trials,
        "parallel": args.parallel,
        "workdir": str(workdir),
        "until": args.until,
        "deployment": args.deployment,
        "storage": args.storage,
    }
    try:
        from prefect.settings import get_current_settings

        if get_current_settings().api.url:
            summary = cifar_search(**arguments)
        else:
            with local_work_pool(args.parallel, workdir / "logs"):
                summary = cifar_search(**arguments)
    except Exception as error:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(traceback.format_exc())
        print(f"error: {type(error).__name__}: {error} (full log: {log_path})", file=sys.stderr)
        return 1
    print(format_search(summary))  # The terminal shows one line of each log record: the summary in full.
    return 0
