"""`make stack-env`: docker/.env from docker/env.example, every missing secret generated and shown this once.

python -m scripts.stack_env [--env-file docker/.env]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.compose import DOCKER_DIR, fill_env_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-file", type=Path, default=DOCKER_DIR / ".env", help="default: docker/.env")
    arguments = parser.parse_args(argv)
    existed = arguments.env_file.is_file()
    generated = fill_env_file(arguments.env_file)
    if not generated:
        print(f"{arguments.env_file}: every secret is set; nothing generated")
        return 0
    action = "added to" if existed else "written to"
    print(f"Generated and {action} {arguments.env_file} (owner-only); shown this once, keep them somewhere safe:")
    for name, value in generated.items():
        print(f"  {name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
