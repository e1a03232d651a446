"""Fuzzing the search-space door (`flows/search.py --space FILE`): JSON or YAML files of any content.

Given any file, expect the command line's own check (flows/search.py `check_request_args`) to accept a
space that round-trips and fits the smoke preset, or to refuse it with one ValueError line naming the
file or the field; YAML's tags never construct anything, aliases never expand without bound.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fuzz_strategies import budget, one_line, space_files
from hypothesis import given

from cifar.search.space import SearchSpace, load_space
from flows.search import build_parser, check_request_args

MARKER = Path(tempfile.gettempdir()) / f"cifar-fuzz-space-ran-code-{os.getpid()}"
MAX_LINE = 3_500  # Characters of the one error line (five fields at most are named), whatever the file held.


@budget(4)
@given(file=space_files(MARKER))
def test_a_space_file_is_accepted_whole_or_refused_in_one_line(file):
    name, data = file
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / name
        path.write_bytes(data)
        arguments = build_parser().parse_args(["--space", str(path), "--preset", "smoke"])
        try:
            _, space = check_request_args(arguments)
        except ValueError as error:
            message = str(error)
            assert one_line(message) and len(message) <= MAX_LINE, message[:3000]
            assert message.startswith(("space", "invalid space: ", "a search ranks")), message[:300]
        else:
            assert load_space(space.model_dump()) == space == SearchSpace.model_validate_json(space.model_dump_json())
            assert space.grid_size() is None or space.grid_size() >= 1
    assert not MARKER.exists(), "a YAML tag ran code"
