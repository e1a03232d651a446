"""The command line of flows/pipeline.py: flags and --set become one validated config, or a clear error."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

from flows.runtime import log_to_file

import pytest

from cifar.config import OFFICIAL_PYTHON_URL, PRESETS, ConfigOverrides, make_config
from cifar.quiet import FRAMEWORK_LOGGERS, VERBOSE_ENV
from flows.cli import ConfigError, config_from_args, parse_overrides, parse_value
from flows.pipeline import build_parser
from harness import REPO_ROOT

SHA256 = "ab" * 32


def config_of(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_defaults_are_the_default_preset_on_the_official_archive():
    args = build_parser().parse_args([])
    assert (args.workdir, args.preset, args.until, args.refresh, args.fresh) == (
        "./workdir",
        "default",
        "export",
        False,
        False,
    )
    assert config_of() == make_config("default")
    assert config_of().data.source == OFFICIAL_PYTHON_URL


def test_source_digests_preset_and_fresh_land_in_the_config():
    config = config_of("--source", "/data/c.tar.gz", "--sha256", SHA256.upper(), "--preset", "smoke", "--fresh")
    assert config.data.source == "/data/c.tar.gz"
    assert config.data.sha256 == SHA256  # Normalised to lower case by the config.
    assert config.preset == "smoke" and config.train.model == make_config("smoke").train.model
    assert config.train.resume is False


def test_set_overrides_parse_json_values_into_nested_sections():
    config = config_of(
        "--preset",
        "smoke",
        "--set",
        "train.epochs=3",
        "--set",
        "train.learning_rate=0.2",
        "--set",
        "train.gpus=[0,1]",
        "--set",
        "evaluate.flip_tta=true",
        "--set",
        "seed=7",
        "--set",
        "train.ema_decay=null",
        "--set",
        "train.model=resnet32",
    )
    assert (config.train.epochs, config.train.learning_rate, config.train.gpus) == (3, 0.2, [0, 1])
    assert config.evaluate.flip_tta is True and config.seed == 7 and config.train.ema_decay is None
    assert config.train.model == "resnet32"
    assert config.train.batch_size == make_config("smoke").train.batch_size  # Untouched preset value.


def test_parse_overrides_and_values():
    assert parse_overrides(["train.epochs=3", "data.source=a=b.tar", "seed=1"]) == {
        "train": {"epochs": 3},
        "data": {"source": "a=b.tar"},
        "seed": 1,
    }
    assert [parse_value(text) for text in ("1", "1.5", "false", "null", "[1]", "tiny", "")] == [
        1,
        1.5,
        False,
        None,
        [1],
        "tiny",
        "",
    ]


@pytest.mark.parametrize(
    "assignment, field",
    [
        ("train.epochs=0", "train.epochs"),
        ("train.model=resnet21", "train.model"),
        ("train.bogus=1", "train.bogus"),
        ("data.sha256=xyz", "data.sha256"),
        ("evaluate.checkpoints=some", "evaluate.checkpoints"),
    ],
)
def test_bad_values_name_the_field(assignment, field):
    with pytest.raises(ConfigError, match=rf"invalid configuration: {field}:"):
        config_of("--set", assignment)


@pytest.mark.parametrize("assignment", ["train.epochs", "=3", "train..epochs=3"])
def test_malformed_set_is_rejected(assignment):
    with pytest.raises(ConfigError, match="section.field=value"):
        config_of("--set", assignment)


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("train.epochs=" + "[" * 100_000, "train.epochs: Input should be a valid integer, unable to parse"),
        ("train.epo\nchs=3", "train.epo\\nchs: Extra inputs are not permitted"),
        ("=" + "x" * 100_000, "section.field=value, got '=xxx"),
    ],
    ids=["nested past the recursion limit", "a newline in the field", "100 KB of value"],
)
def test_any_set_value_fails_with_one_short_line(assignment, message):
    # Found by the fuzz suite (issue 39): a RecursionError, a line broken in two, the 100 KB echoed back.
    with pytest.raises(ConfigError) as raised:
        config_of("--set", assignment)
    assert message in str(raised.value) and "\n" not in str(raised.value) and len(str(raised.value)) < 400


@pytest.mark.slow
def test_bad_config_exits_2_with_the_field_before_any_work(tmp_path):
    workdir = tmp_path / "workdir"
    result = subprocess.run(
        [sys.executable, "flows/pipeline.py", "--workdir", str(workdir), "--set", "train.epochs=-1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "train.epochs" in result.stderr and "greater than or equal to 1" in result.stderr
    assert not workdir.exists()


def test_unknown_preset_and_stage_are_rejected_by_the_parser(capsys):
    for argv in (["--preset", "huge"], ["--until", "deploy"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
    assert "invalid choice: 'deploy'" in capsys.readouterr().err


def test_a_partial_config_is_completed_from_its_preset():
    # What a deployment passes: the preset's own settings plus the explicit ones on top.
    config = ConfigOverrides.model_validate({"preset": "smoke", "train": {"epochs": 5}}).resolve()
    assert config.train.epochs == 5
    assert config.train.model == make_config("smoke").train.model
    assert config.evaluate.flip_tta is False  # From the smoke preset, not the default.
    for preset in PRESETS:  # Every field given: resolves to exactly that config.
        assert ConfigOverrides.of(make_config(preset)).resolve() == make_config(preset)


def test_a_form_left_alone_resolves_to_the_deployment_preset():
    # The Prefect UI fills each form field with its schema default: every one of them is empty.
    schema = ConfigOverrides.model_json_schema()
    form = ConfigOverrides().model_dump(mode="json")
    for preset in PRESETS:
        submitted = ConfigOverrides.model_validate(form | {"preset": preset})
        assert submitted.resolve() == make_config(preset)
    assert schema["properties"]["preset"]["enum"] == sorted(PRESETS, key=list(PRESETS).index)
    train = schema["$defs"]["TrainConfigOverrides"]["properties"]
    assert {"type": "null"} in train["epochs"]["anyOf"] and "from the preset" in train["epochs"]["description"]


def test_deployment_descriptions_state_their_preset_truthfully():
    # The "Custom run" form shows None for every field: the description says what the preset runs.
    import yaml

    for deployment in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]:
        if "config" not in deployment["parameters"]:  # cifar-promote: no training, no preset.
            continue
        preset = deployment["parameters"]["config"]["preset"]
        train = make_config(preset).train
        if deployment["name"] in {"smoke", "full", "nightly"}:
            assert (
                f"{preset.capitalize()} preset: model {train.model}, {train.epochs} epochs" in deployment["description"]
            )
        if deployment["name"] == "nightly":
            assert "UTC" in deployment["description"] and deployment["schedules"][0]["timezone"] == "UTC"


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "CIFAR_VERBOSE=1"])
def test_the_terminal_gets_one_line_of_ours_and_the_log_file_every_line(tmp_path, monkeypatch, verbose):
    # What the command line's child does before its flow runs, on a terminal handler like Prefect's.
    stream = io.StringIO()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(stream)])
    for name in FRAMEWORK_LOGGERS:  # Restored afterwards, as MLflow configured them.
        logger = logging.getLogger(name)
        for attribute in ("handlers", "level", "propagate"):
            monkeypatch.setattr(logger, attribute, getattr(logger, attribute))
    monkeypatch.setenv("MLFLOW_CONFIGURE_LOGGING", "true")
    monkeypatch.setenv(VERBOSE_ENV, "1" if verbose else "0")

    path = log_to_file(tmp_path)
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
    logging.getLogger("mlflow.tracking").warning("A warning of MLflow's")
    try:
        raise RuntimeError("the cause")
    except RuntimeError:
        logging.getLogger("tasks.training").exception("Training failed")
    for handler in root.handlers:
        handler.flush()
        if isinstance(handler, logging.FileHandler):
            handler.close()

    terminal, logged = stream.getvalue(), path.read_text()
    assert "Training failed" in terminal and "the cause" not in terminal  # One line, no traceback.
    assert "A warning of MLflow's" in terminal
    assert ("Creating initial MLflow database tables" in terminal) == verbose
    assert "INFO mlflow.store.db.utils: Creating initial MLflow database tables..." in logged
    assert "RuntimeError: the cause" in logged and "A warning of MLflow's" in logged


def test_the_temporary_server_is_started_as_prefects_own_client_starts_it(monkeypatch):
    """The supervisor starts Prefect's temporary server itself (flows.runtime.TemporaryServer), so the run's
    process need not import Prefect's server package: the same command and environment as Prefect's client."""
    from flows.runtime import TemporaryServer

    from prefect.server.api import server as prefect_server

    started = {}
    monkeypatch.setattr(prefect_server.subprocess, "Popen", lambda args, env: started.update(args=args, env=env))
    prefect_server.SubprocessASGIServer(port=4399)._run_uvicorn_command()
    assert started["args"] == TemporaryServer.command(4399)
    assert started["env"] == TemporaryServer.environment()
