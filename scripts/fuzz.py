"""`make fuzz`: each door of the fuzz suite (tests/test_fuzz_<door>.py) for its share of the time, new seeds each round.

    python -m scripts.fuzz [--minutes 10] [--doors archives,configs]

Hypothesis has no time budget, so each door runs in rounds: pytest on its file under the `fuzz` profile
(harness/fuzz.py) with a new seed and as many examples per property as fit into most of the door's time left
at the speed of its slowest round so far (and at most four times the last round's: later examples grow).
Failing examples are kept in .hypothesis/examples/ and tried first by every later run. Prints per door the
rounds and the test cases run; exits 1 when a door found a failure.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import REPO_ROOT
from harness.fuzz import EXAMPLE_DATABASE, EXAMPLES_ENV, PROFILE_ENV

FIRST_ROUND_EXAMPLES = 10  # Per property: measures the door's speed (and its start-up, TensorFlow's import included).
MAX_ROUND_SECONDS = 240  # Rounds stay short, so a long run tries many seeds.
MAX_ROUND_EXAMPLES = 20_000
ROUND_SHARE = 0.8  # Of the time left a round is sized for: the rate is an estimate.
# `--hypothesis-show-statistics` prints, per property and phase, "- during generate phase (1.23 seconds):" and
# below it "- 100 passing, 0 failing, and 3 invalid test cases" (Hypothesis 6.1xx: the pinned version).
PHASE = re.compile(r"during (\w+) phase \(([\d.]+) seconds\):.*?(\d+) passing, (\d+) failing, and (\d+) invalid", re.S)


@dataclass
class Door:
    name: str
    path: Path
    rounds: int = 0
    passing: int = 0
    failing: int = 0
    invalid: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # The output of each failed round's end.

    def line(self) -> str:
        result = f"FAILED ({len(self.failures)} rounds)" if self.failures else "nothing found"
        return (
            f"{self.name:<20} {self.rounds:>6} {self.passing + self.failing:>10,} {self.invalid:>9,} "
            f"{self.seconds:>8.0f}  {result}"
        )


def doors(names: list[str] | None) -> list[Door]:
    """The suite's doors, found from the test files' names."""
    found = {
        path.stem.removeprefix("test_fuzz_"): path for path in sorted((REPO_ROOT / "tests").glob("test_fuzz_*.py"))
    }
    unknown = sorted(set(names or []) - set(found))
    if unknown:
        raise SystemExit(f"error: no door {', '.join(unknown)}; the doors are {', '.join(found)}")
    return [Door(name, path) for name, path in found.items() if not names or name in names]


def run_round(door: Door, examples: int, seed: int) -> tuple[float, float]:
    """One pytest run of the door's file; returns (its wall seconds, the seconds its properties ran)."""
    command = [
        sys.executable, "-m", "pytest", str(door.path), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
        f"--hypothesis-seed={seed}", "--hypothesis-show-statistics", "--timeout=1800",
    ]  # fmt: skip
    environment = {**os.environ, PROFILE_ENV: "fuzz", EXAMPLES_ENV: str(examples)}
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True)
    wall = time.monotonic() - start
    output = result.stdout + result.stderr
    running = 0.0
    for phase, seconds, passing, failing, invalid in PHASE.findall(output):
        if phase == "shrink":  # Re-runs of a failing example while Hypothesis minimises it.
            continue
        running += float(seconds)
        door.passing, door.failing = door.passing + int(passing), door.failing + int(failing)
        door.invalid += int(invalid)
    door.rounds, door.seconds = door.rounds + 1, door.seconds + wall
    if result.returncode != 0:
        door.failures.append(f"round {door.rounds} (seed {seed}, {examples} examples):\n{output[-6000:]}")
    return wall, running


def fuzz(door: Door, seconds: float, seeds: random.Random) -> None:
    """Rounds of `door` until its `seconds` are spent (or it fails): each as large as its measured rate fits."""
    deadline = time.monotonic() + seconds
    examples, per_example = FIRST_ROUND_EXAMPLES, 0.0
    while not door.failures:
        wall, running = run_round(door, examples, seeds.randrange(2**32))
        weighted = f"{examples:,} examples x each property's weight"
        print(f"    {door.name} round {door.rounds}: {weighted}, {wall:.0f} s", flush=True)
        start_up = max(wall - running, 0.0)
        # Seconds per example of every property together: the slowest round's, as seeds make rounds unlike.
        per_example = max(per_example, max(running, 0.01) / examples)
        left = min(deadline - time.monotonic(), MAX_ROUND_SECONDS) - start_up
        if left < 5 * per_example:
            return
        examples = int(min(ROUND_SHARE * left / per_example, 4 * examples, MAX_ROUND_EXAMPLES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="the whole run, split evenly among the doors")
    parser.add_argument("--doors", help="comma-separated doors to run (default: every tests/test_fuzz_*.py)")
    parser.add_argument("--seed", type=int, help="seeds the rounds' seeds (default: a new one, printed)")
    args = parser.parse_args(argv)
    selected = doors(args.doors.split(",") if args.doors else None)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    share = 60 * args.minutes / len(selected)
    print(f"Fuzzing {len(selected)} doors for {args.minutes:g} minutes ({share:.0f} s each), --seed {seed}; "
          f"failing examples are kept in {EXAMPLE_DATABASE.relative_to(REPO_ROOT)}/", flush=True)  # fmt: skip
    seeds = random.Random(seed)
    for door in selected:
        fuzz(door, share, seeds)
        print(f"  {door.name}: {door.passing + door.failing:,} test cases in {door.rounds} rounds", flush=True)
    print(f"\n{'door':<20} {'rounds':>6} {'test cases':>10} {'invalid':>9} {'seconds':>8}  result")
    for door in selected:
        print(door.line())
    failed = [door for door in selected if door.failures]
    for door in failed:
        print(f"\n--- {door.name}: {door.failures[0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
