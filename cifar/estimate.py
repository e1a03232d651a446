"""How long a training will take on this CPU, said before it starts; what it took, remembered for next time.

Before a training (or the rest of a resumed one) starts, `estimate_training` gives one line: the speed it
assumes, where that speed comes from, and the time for the epochs left. The speed is, most trusted first:

1. remembered: what this pipeline trained at here the last time it trained this model in this precision, batch
   and number of replicas, on this CPU with these libraries (whole epochs, validation included; `SpeedMemory`
   records it after every epoch, so a killed run teaches too);
2. timed: a few training steps of the model alone (the precision choice's timing, or timed now), times
   PIPELINE_SHARE: the pipeline trains slower than the model alone (input pipeline, callbacks, validation);
3. none: a training shorter than MIN_IMAGES_TO_TIME images is not worth timing; the line says so.

Where another preset reaches within ACCURACY_MARGIN points of this one's in at most half the time (the figures in
PRESET_RESULTS), the line says so, and an estimate longer than a coffee break names the preset that fits one here;
nothing is switched.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from datetime import UTC, datetime
from pathlib import Path

import keras

from cifar import locks
from cifar.config import PipelineConfig, TrainConfig, make_config
from cifar.io import atomic_write_json, cache_directory, read_json
from cifar.text import duration

logger = logging.getLogger(__name__)

SPEED_FILE = "training_speed.json"  # In this machine's cache directory (cifar.io), beside precision.json.
# The pipeline's images/s against a few compiled steps of the model alone on one fixed batch of 128 (cifar.performance):
# 0.92 for `sprint` here (the fast net in bfloat16 at batch 512, AMD EPYC family 25 model 17, 2026-11-28: 401 against
# 436 images/s), about 0.8 on an Intel Xeon, 0.58 for ResNet-56 in float32 on a Zen 3 (issue 49). A first estimate
# is rough; the next run here remembers the pipeline's own speed.
PIPELINE_SHARE = 0.8
MIN_IMAGES_TO_TIME = 50_000  # One CIFAR-10 epoch: shorter trainings are not timed only to be estimated.
ACCURACY_MARGIN = 2.0  # Points of test accuracy a faster preset may lose and still be named.
COFFEE_BREAK_SECONDS = 20 * 60  # An estimate longer than this names the preset that trains here within it.
# Each preset's test accuracy (flip + translate TTA where measured) and training minutes, on one CPU with bfloat16
# math (AMD EPYC, 2 cores): docs/BENCHMARKS.md "Time to accuracy" and "Recipe results".
PRESET_RESULTS: dict[str, tuple[float, float]] = {
    "fast": (91.97, 21.6),
    "sprint": (87.47, 4.2),
    "default": (84.41, 28.8),
    "full": (89.88, 764.4),
}


@dataclasses.dataclass(frozen=True)
class TrainingEstimate:
    """The time the epochs left should take here, the speed it assumes and where that speed comes from."""

    epochs: int  # Left to train.
    images: int  # Left to train: epochs x steps x global batch.
    images_per_second: float | None  # None: not timed (a short training).
    source: str
    hint: str | None = None  # A faster preset within ACCURACY_MARGIN points, when there is one.
    coffee_break: str | None = None  # For a long estimate: the preset that trains here in a coffee break.
    key: str = ""  # What the speed depends on (speed_key): where this training's own speed is remembered.

    @property
    def seconds(self) -> float | None:
        return self.images / self.images_per_second if self.images_per_second else None

    def describe(self) -> str:
        work = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''} of {self.images:,} images in all"
        if self.seconds is None:
            line = f"Training estimate: none for {work} ({self.source})"
        else:
            speed = f"{self.images_per_second:,.0f} images/s"
            line = f"Training estimate: {duration(self.seconds)} for {work} at {speed} ({self.source})"
        return ". ".join(part for part in (line, self.hint, self.coffee_break) if part)

    def tags(self) -> dict[str, str]:
        """For the run (a tag per attempt: a resumed attempt estimates what is left)."""
        tags = {"estimate": self.describe()}
        if self.seconds is not None:
            tags["estimate.minutes"] = f"{self.seconds / 60:.1f}"
        return tags


def speed_key(train: TrainConfig, precision: str, num_replicas: int) -> str:
    """What a training's speed depends on: what the precision choice's timing does (the CPU, the libraries, the
    model as the run builds it), then the precision, the run's own batch and how many replicas share it."""
    from cifar.performance import precision_cache_key

    return f"{precision_cache_key(train)} | {precision} | global batch {train.batch_size} | replicas {num_replicas}"


def speed_path() -> Path:
    return cache_directory() / SPEED_FILE


def remembered_speed(key: str) -> dict | None:
    """{"images_per_second", "measured_at", "run"} of the last training under `key` here, or None."""
    try:
        speeds = read_json(speed_path())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:  # A damaged file is not trusted: the next training writes it again.
        logger.warning("Ignoring the unreadable training speeds %s: %s", speed_path(), error)
        return None
    entry = speeds.get(key) if isinstance(speeds, dict) else None
    speed = entry.get("images_per_second") if isinstance(entry, dict) else None
    return entry if isinstance(speed, int | float) and speed > 0 else None


def remember_speed(key: str, images_per_second: float, run_name: str) -> None:
    path = speed_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with locks.exclusive(path.with_name(path.name + ".lock"), "the remembered training speeds"):
        try:
            speeds = read_json(path)
        except (OSError, ValueError):
            speeds = {}
        speeds = speeds if isinstance(speeds, dict) else {}
        at = f"{datetime.now(UTC):%Y-%m-%d}"
        speeds[key] = {"images_per_second": round(images_per_second, 1), "measured_at": at, "run": run_name}
        atomic_write_json(path, speeds)


def estimate_training(
    config: PipelineConfig,
    performance: dict[str, str],
    steps_per_epoch: int,
    epochs_left: int,
    num_replicas: int,
    num_workers: int = 1,
    *,
    time_steps=None,
) -> TrainingEstimate:
    """The estimate for `epochs_left` epochs of `steps_per_epoch` steps, at the speed most trusted (module doc).

    `performance` is what cifar.performance.configure_performance resolved (the precision, and the timing behind a
    measured choice); `time_steps(train, precisions)` times the model alone (cifar.performance's, by default).
    """
    train = config.train
    precision = performance.get("precision", "float32")
    images = epochs_left * steps_per_epoch * train.batch_size
    key = speed_key(train, precision, num_replicas)
    base = {"epochs": epochs_left, "images": images, "hint": faster_preset_hint(config), "key": key}
    remembered = remembered_speed(key)
    if remembered is not None:
        source = (
            f"remembered: this pipeline trained {train.model} in {precision} at that speed here on "
            f"{remembered['measured_at']}, run {remembered.get('run', '?')}"
        )
        return with_coffee_break(
            TrainingEstimate(images_per_second=remembered["images_per_second"], source=source, **base), config
        )
    from cifar.performance import MEASURE_BATCH_SIZE, measure_images_per_second

    # The kernel choice's timing of the variant chosen, else the precision choice's (cifar.performance).
    timed = performance.get("kernels_images_per_second") or performance.get(f"precision_{precision}_images_per_second")
    if timed is None and images >= MIN_IMAGES_TO_TIME and num_workers == 1:  # A worker of a job never waits for it.
        logger.info("Timing a few training steps of %s in %s for the estimate", train.model, precision)
        policy = keras.mixed_precision.global_policy()
        try:
            timed = (time_steps or measure_images_per_second)(train, (precision,))[precision]
        finally:
            keras.mixed_precision.set_global_policy(policy)  # The timing leaves float32 behind.
    if timed is None:
        reason = f"shorter than {MIN_IMAGES_TO_TIME:,} images" if images < MIN_IMAGES_TO_TIME else "a multi-worker job"
        source = f"not timed: {reason}; the next run here remembers this one's speed"
        return TrainingEstimate(images_per_second=None, source=source, **base)
    keras_layers = [name for key, name in (("fused_batchnorm", "batch norm"), ("fused_gelu", "GELU"))
                    if performance.get(key) == "false"]  # fmt: skip
    kernels = f" with Keras's {' and '.join(keras_layers)}" if keras_layers else ""
    source = (
        f"timed: {float(timed):,.0f} images/s for {train.model} alone in {precision}{kernels} at batch "
        f"{min(train.batch_size, MEASURE_BATCH_SIZE)}, x{PIPELINE_SHARE} for the pipeline; a rough first figure, "
        "the next run here remembers this one's speed"
    )
    return with_coffee_break(
        TrainingEstimate(images_per_second=float(timed) * PIPELINE_SHARE, source=source, **base), config
    )


def announce_estimate(
    config: PipelineConfig, performance: dict[str, str], steps_per_epoch: int, epochs_done: int, plan
) -> TrainingEstimate | None:
    """The estimate for the epochs a training has left, logged before they start: the chief's (None elsewhere, and
    when none are left). `plan` is the run's cifar.distribute device plan."""
    if not plan.is_chief or epochs_done >= config.train.epochs:
        return None
    epochs_left = config.train.epochs - epochs_done
    estimate = estimate_training(config, performance, steps_per_epoch, epochs_left, plan.num_replicas, plan.num_workers)
    logger.info("%s", estimate.describe())
    return estimate


def with_coffee_break(estimate: TrainingEstimate, config: PipelineConfig) -> TrainingEstimate:
    """An estimate longer than a coffee break names the preset that fits one here (its time scaled from this one's
    by PRESET_RESULTS), for a run of a preset as it stands: on a CPU without bfloat16 math `fast` takes 1.5 hours."""
    name, seconds = config.preset, estimate.seconds
    if seconds is None or seconds <= COFFEE_BREAK_SECONDS or not _unmodified_preset(config):
        return estimate
    minutes = PRESET_RESULTS[name][1]
    fits = [(accuracy, other, seconds * other_minutes / minutes) for other, (accuracy, other_minutes) in
            PRESET_RESULTS.items() if seconds * other_minutes / minutes <= COFFEE_BREAK_SECONDS]  # fmt: skip
    if not fits:
        return estimate
    accuracy, other, other_seconds = max(fits)
    took = duration(other_seconds)
    line = f"For a coffee break: `--preset {other}` ({accuracy:.1f} % test accuracy) would take {took} here"
    return dataclasses.replace(estimate, coffee_break=line)


def _unmodified_preset(config: PipelineConfig) -> bool:
    return config.preset in PRESET_RESULTS and config.train == make_config(config.preset).train


def faster_preset_hint(config: PipelineConfig) -> str | None:
    """A preset reaching within ACCURACY_MARGIN points of the run's preset in at most half its time, if any: the
    most accurate such one. Only for a run of a preset as it stands (its training fields not overridden)."""
    name = config.preset
    if not _unmodified_preset(config):
        return None
    accuracy, minutes = PRESET_RESULTS[name]
    faster = [
        (other_accuracy, other, other_minutes)
        for other, (other_accuracy, other_minutes) in PRESET_RESULTS.items()
        if other != name and other_minutes <= minutes / 2 and other_accuracy >= accuracy - ACCURACY_MARGIN
    ]
    if not faster:
        return None
    other_accuracy, other, other_minutes = max(faster)
    return (
        f"The `{other}` preset reached {other_accuracy:.1f} % test accuracy (`{name}`: {accuracy:.1f} %) in "
        f"{other_minutes / minutes:.2g}x the time on a CPU with bfloat16 math (docs/BENCHMARKS.md); "
        f"--preset {other} to use it"
    )


def epoch_seconds_median(seconds: list[float]) -> float | None:
    """The typical epoch: the median, leaving out an attempt's first epoch (tracing) when there are later ones."""
    usable = seconds[1:] if len(seconds) > 1 else seconds
    return statistics.median(usable) if usable else None


class SpeedMemory(keras.callbacks.Callback):
    """Remembers this training's speed (whole epochs, validation included) after every epoch, for the next estimate."""

    def __init__(self, estimate: TrainingEstimate, run_name: str) -> None:
        super().__init__()
        self.key, self.images_per_epoch, self.run_name = estimate.key, estimate.images // estimate.epochs, run_name
        self.seconds: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        if logs and logs.get("epoch_seconds"):
            self.seconds.append(float(logs["epoch_seconds"]))
            typical = epoch_seconds_median(self.seconds)
            try:
                remember_speed(self.key, self.images_per_epoch / typical, self.run_name)
            except OSError as error:  # A read-only cache costs the next estimate, never the training.
                logger.warning("Could not remember the training speed in %s: %s", speed_path(), error)
