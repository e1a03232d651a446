"""Fuzzing the configuration doors: a deployment form's `config` (any JSON against the schema) and `--set`.

Given any document, expect a config that round-trips (JSON, and as overrides) with every number finite,
or one ValueError line naming the fields at fault, bounded in length whatever was sent; an accepted config
then passes the machine's pre-flight checks or fails them with one line (ImpossibleRequestError).
"""

from __future__ import annotations

import argparse
import math

from fuzz_strategies import budget, config_documents, one_line, set_assignments
from hypothesis import given
from pydantic import ValidationError

from cifar.config import ConfigOverrides, PipelineConfig
from cifar.preflight import ImpossibleRequestError, check_request
from flows.cli import MAX_LISTED_ERRORS, ConfigError, describe_validation_error, overrides_from_args

MAX_LINE_PER_FIELD = 600  # Characters of the error line per field at fault, whatever the value sent was.
PLENTY_OF_MEMORY = 1 << 40


def check_accepted(config: PipelineConfig) -> None:
    for field, value in config.flat().items():
        assert not isinstance(value, float) or math.isfinite(value), f"{field} accepted {value}"
    assert PipelineConfig.model_validate_json(config.model_dump_json()) == config  # As a form stores it.
    assert ConfigOverrides.of(config).resolve() == config
    try:
        check_request(config, available=PLENTY_OF_MEMORY)
    except ImpossibleRequestError as error:
        assert one_line(str(error))


@budget(4)
@given(document=config_documents())
def test_a_form_config_resolves_to_a_valid_config_or_names_its_fields_in_one_line(document):
    try:
        config = ConfigOverrides.model_validate(document).resolve()
    except ValidationError as error:
        message = describe_validation_error(error)
        assert one_line(message) and message.startswith("invalid configuration: ")
        assert len(message) <= MAX_LINE_PER_FIELD * min(error.error_count(), MAX_LISTED_ERRORS), message[:2000]
    except ValueError as error:  # An unknown preset, named.
        assert one_line(str(error)) and len(str(error)) <= MAX_LINE_PER_FIELD, str(error)[:2000]
    else:
        check_accepted(config)


@budget(4)
@given(assignments=set_assignments())
def test_set_arguments_resolve_or_fail_with_one_line_naming_the_field(assignments):
    arguments = argparse.Namespace(set=assignments)
    try:
        overrides = overrides_from_args(arguments)
    except ConfigError as error:
        assert one_line(str(error)), str(error)
        assert len(str(error)) <= MAX_LINE_PER_FIELD * MAX_LISTED_ERRORS, str(error)[:2000]
    else:
        check_accepted(overrides.resolve())
