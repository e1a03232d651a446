"""The config object: presets, overrides and clear errors that name the field."""

import pytest
from pydantic import ValidationError

from cifar.config import PRESETS, make_config


def test_every_preset_validates():
    for name in PRESETS:
        assert make_config(name).preset == name


def test_preset_overrides_only_what_differs():
    default, smoke = make_config("default"), make_config("smoke")
    assert smoke.train.model == "tutorial" and smoke.train.epochs == 2
    assert smoke.train.momentum == default.train.momentum
    assert smoke.data == default.data


def test_overrides_merge_into_preset():
    config = make_config("smoke", {"train": {"epochs": 3}})
    assert config.train.epochs == 3 and config.train.model == "tutorial"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"train": {"epochs": -1}}, "train.epochs"),
        ({"train": {"model": "resnet21"}}, "train.model"),
        ({"train": {"model": "vgg"}}, "train.model"),
        ({"train": {"gpus": -2}}, "train.gpus"),
        ({"data": {"sha256": "xyz"}}, "data.sha256"),
        ({"data": {"validation_size": 50_000}}, "data.validation_size"),
        ({"train": {"unknown_field": 1}}, "train.unknown_field"),
        # Found by the fuzz suite (issue 39): accepted, then training crashed converting infinity to steps.
        ({"train": {"whitening_bias_epochs": float("inf")}}, "train.whitening_bias_epochs"),
        ({"monitor": {"max_image_drift": float("nan")}}, "monitor.max_image_drift"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValidationError) as error:
        make_config("default", overrides)
    assert field in str(error.value)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        make_config("nope")


def test_official_md5_applies_only_to_official_source():
    assert make_config().data.expected_md5() == "c58f30108f718f92721af3b95e74349a"
    local = make_config("default", {"data": {"source": "/tmp/x.tar.gz", "sha256": "a" * 64}})
    assert local.data.expected_md5() is None


def test_the_preset_is_a_closed_choice_that_lists_every_preset():
    from typing import get_args

    from cifar.config import PRESETS, PipelineConfig, PresetName

    assert set(get_args(PresetName)) == set(PRESETS)
    assert PipelineConfig.model_json_schema()["properties"]["preset"]["enum"] == list(get_args(PresetName))
    with pytest.raises(ValueError, match="preset"):
        PipelineConfig(preset="smok")
