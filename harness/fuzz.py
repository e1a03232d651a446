"""The fuzz suite's Hypothesis profiles, shared by tests/conftest.py (which loads one) and scripts/fuzz.py (make fuzz).

ci (the default, make test): derandomized, so the same examples every run, a few per property, no example
database. fuzz (make fuzz): new seeds each run, CIFAR_FUZZ_EXAMPLES per property, failing examples kept in
the git-ignored .hypothesis/examples/ and tried first next time.
"""

from __future__ import annotations

import os

from harness import REPO_ROOT

PROFILE_ENV = "CIFAR_FUZZ_PROFILE"  # ci or fuzz
EXAMPLES_ENV = "CIFAR_FUZZ_EXAMPLES"  # Examples per property in the fuzz profile (a test's `budget` scales it).
EXAMPLE_DATABASE = REPO_ROOT / ".hypothesis" / "examples"
CI_EXAMPLES = 10  # Per property in make test; tests/test_fuzz_*.py weigh it by each property's cost.


def load_profile() -> str:
    """Registers both profiles and loads the one PROFILE_ENV names (ci when unset); returns its name."""
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    # Generated files and trees are large and slow by design; a property has no time limit per example.
    common = {
        "deadline": None,
        "print_blob": True,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    }
    settings.register_profile("ci", max_examples=CI_EXAMPLES, derandomize=True, database=None, **common)
    examples = int(os.environ.get(EXAMPLES_ENV, "200"))
    database = DirectoryBasedExampleDatabase(str(EXAMPLE_DATABASE))
    settings.register_profile("fuzz", max_examples=examples, database=database, **common)
    name = os.environ.get(PROFILE_ENV, "ci")
    settings.load_profile(name)
    return name
