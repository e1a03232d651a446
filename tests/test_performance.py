"""Speed settings: precision and XLA resolution per device kind, the bf16 CPU check, and that
bfloat16 training with the fused batch norm still learns."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from cifar import performance
from cifar.config import TrainConfig
from cifar.data.synthetic import make_split
from cifar.io import CACHE_DIR_ENV
from cifar.models import build_model

CPUINFO_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep avx2 avx512f avx512bw"


BF16_FASTER = lambda train: {"float32": 200.0, "mixed_bfloat16": 300.0}  # noqa: E731 (a fake measurement)


@pytest.fixture(autouse=True)
def own_precision_cache(tmp_path, monkeypatch):
    """Each test remembers measured precisions in a cache of its own."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))


@pytest.fixture
def machine(monkeypatch):
    """Pretends to be a given machine: `machine(cpu_bf16=..., gpus=[(major, minor), ...])`."""

    def pretend(cpu_bf16: bool = False, gpus: list[tuple[int, int]] | None = None) -> None:
        monkeypatch.setattr(performance, "cpu_supports_bf16", lambda: cpu_bf16)
        monkeypatch.setattr(performance, "gpu_compute_capabilities", lambda num_gpus: list(gpus or [])[:num_gpus])

    return pretend


def write_cpuinfo(tmp_path, extra_flags: str) -> str:
    path = tmp_path / "cpuinfo"
    processor = "processor\t: {index}\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n"
    flags = f"{CPUINFO_FLAGS} {extra_flags}"
    path.write_text("".join(processor.format(index=index, flags=flags) for index in range(2)))
    return str(path)


@pytest.mark.parametrize(
    "extra_flags,expected", [("amx_bf16 amx_tile", True), ("avx512_bf16", True), ("avx512_fp16", False), ("", False)]
)
def test_cpu_supports_bf16_reads_cpuinfo_flags(tmp_path, extra_flags, expected):
    assert performance.cpu_supports_bf16(write_cpuinfo(tmp_path, extra_flags)) is expected


@pytest.mark.parametrize(
    "extra_flags,expected",
    [("avx512_bf16 amx_tile amx_bf16", ("amx_bf16", "avx512_bf16")), ("avx512_bf16", ("avx512_bf16",)), ("", ())],
)
def test_cpu_bf16_flags_names_each_instruction_set(tmp_path, extra_flags, expected):
    assert performance.cpu_bf16_flags(write_cpuinfo(tmp_path, extra_flags)) == expected


def test_cpu_supports_bf16_is_false_without_cpuinfo(tmp_path):
    assert performance.cpu_supports_bf16(tmp_path / "missing") is False


@pytest.mark.parametrize(
    "cpu_bf16,gpus,num_gpus,expected",
    [
        (True, [], 0, "mixed_bfloat16"),  # Sapphire Rapids and newer (AMX), AMD EPYC: measured faster.
        (False, [], 0, "float32"),  # Emulated bfloat16 would be slower than float32.
        (True, [(8, 0)], 1, "mixed_bfloat16"),  # A100.
        (False, [(9, 0), (9, 0)], 2, "mixed_bfloat16"),  # H100s.
        (False, [(7, 0)], 1, "mixed_float16"),  # V100: float16 tensor cores only.
        (False, [(8, 6), (7, 5)], 2, "mixed_float16"),  # Mixed generations: the oldest decides.
        (False, [], 1, "mixed_float16"),  # A GPU without reported details.
    ],
)
def test_auto_precision_per_device(machine, cpu_bf16, gpus, num_gpus, expected):
    machine(cpu_bf16=cpu_bf16, gpus=gpus)
    choice = performance.resolve_precision(TrainConfig(precision="auto"), num_gpus, measure=BF16_FASTER)
    assert choice.precision == expected


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_explicit_precision_is_kept(machine, precision):
    machine(cpu_bf16=False, gpus=[(8, 0)])
    for num_gpus in (0, 1):
        choice = performance.resolve_precision(TrainConfig(precision=precision), num_gpus)
        assert (choice.precision, choice.reason) == (precision, "configured")


@pytest.mark.parametrize(
    "setting,num_gpus,expected",
    [("auto", 0, False), ("auto", 1, True), ("auto", 4, True), ("on", 0, True), ("off", 2, False)],
)
def test_jit_compile_resolution(setting, num_gpus, expected):
    assert performance.resolve_jit_compile(TrainConfig(jit_compile=setting), num_gpus) is expected


def test_negative_gpu_count_is_a_value_error():
    with pytest.raises(ValueError):
        performance.resolve_precision(TrainConfig(), -1)
    with pytest.raises(ValueError):
        performance.resolve_jit_compile(TrainConfig(), -1)


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("0", False), ("false", False)])
def test_onednn_enabled_reads_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    else:
        monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", value)
    assert performance.onednn_enabled() is expected


def test_configure_performance_sets_the_policy_and_reports_strings(machine, monkeypatch):
    machine(cpu_bf16=True)
    monkeypatch.setattr(performance, "measure_images_per_second", BF16_FASTER)
    kernels = lambda train, precision, layers: {"fused": 300.0, "keras_batchnorm": 200.0}  # noqa: E731
    monkeypatch.setattr(performance, "measure_kernel_variants", kernels)
    settings = performance.configure_performance(TrainConfig(precision="auto", jit_compile="auto"), 0)
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    assert settings["precision"] == "mixed_bfloat16"
    assert settings["jit_compile"] == "false"
    assert settings["device"] == "cpu"
    assert settings["precision_mixed_bfloat16_images_per_second"] == "300.0"
    assert settings["precision_reason"] in ("measured", "remembered")
    assert (settings["fused_batchnorm"], settings["kernels_reason"]) == ("true", "measured")  # Timed in bfloat16.
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in settings.items())

    machine(cpu_bf16=False, gpus=[(7, 0)])
    settings = performance.configure_performance(TrainConfig(precision="auto"), 1)
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    assert (settings["precision"], settings["jit_compile"], settings["device"]) == ("mixed_float16", "true", "gpu x1")


def test_configure_performance_rejects_negative_threads():
    with pytest.raises(ValueError):
        performance.configure_performance(TrainConfig(precision="float32"), 0, intra_op_threads=-1)


@pytest.mark.slow
def test_bfloat16_training_with_fused_batchnorm_converges():
    """resnet8 under mixed_bfloat16 learns the colour-coded synthetic classes within a few epochs."""
    performance.configure_performance(TrainConfig(precision="mixed_bfloat16", fused_batchnorm=True), 0)
    keras.utils.set_random_seed(0)
    images, labels = make_split(320, seed=7)  # (320, 32, 32, 3) uint8, 32 images per class.
    model = build_model("resnet8", mean=images.mean(axis=(0, 1, 2)) / 255, std=images.std(axis=(0, 1, 2)) / 255)
    assert model.get_layer("stem_conv").compute_dtype == "bfloat16"
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(images, labels.astype(np.int32), batch_size=32, epochs=4, verbose=0, shuffle=True).history
    losses = history["loss"]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], f"loss should fall by half: {losses}"
    assert history["accuracy"][-1] > 0.5, f"accuracy should beat chance (0.1) clearly: {history['accuracy']}"


class Timings:
    """A fake measurement that counts its calls."""

    def __init__(self, float32: float, bfloat16: float) -> None:
        self.speeds = {"float32": float32, "mixed_bfloat16": bfloat16}
        self.calls = 0

    def __call__(self, train: TrainConfig) -> dict[str, float]:
        self.calls += 1
        return dict(self.speeds)


@pytest.mark.parametrize(
    "float32,bfloat16,expected",
    [
        (194.0, 145.0, "float32"),  # The 2-core Xeon without AMX exposed (issue 36): bf16 0.75x.
        (200.0, 300.0, "mixed_bfloat16"),  # AMD EPYC: bf16 1.5x.
        (200.0, 205.0, "float32"),  # Within the noise: float32 is exact, so it wins the tie.
    ],
)
def test_auto_on_a_bf16_cpu_picks_the_faster_precision_as_measured(machine, float32, bfloat16, expected):
    machine(cpu_bf16=True)
    timings = Timings(float32, bfloat16)
    choice = performance.resolve_precision(TrainConfig(model="resnet56"), 0, measure=timings)
    assert (choice.precision, choice.reason, timings.calls) == (expected, "measured", 1)
    assert choice.images_per_second == timings.speeds
    assert choice.settings()["precision_float32_images_per_second"] == f"{float32:.1f}"


def test_a_measured_choice_is_remembered_per_model_and_machine(machine):
    machine(cpu_bf16=True)
    timings = Timings(194.0, 145.0)
    for _ in range(2):
        choice = performance.resolve_precision(TrainConfig(model="resnet56"), 0, measure=timings)
        assert choice.precision == "float32"
    assert (timings.calls, choice.reason) == (1, "remembered")
    performance.resolve_precision(TrainConfig(model="resnet20"), 0, measure=timings)  # Another model: measured.
    assert timings.calls == 2
    cache = json.loads(performance.precision_cache_path().read_text())
    key = performance.precision_cache_key(TrainConfig(model="resnet56"))
    assert cache[key]["images_per_second"] == {"float32": 194.0, "mixed_bfloat16": 145.0}
    assert performance.cpu_model_name() in key and tf.__version__ in key and keras.__version__ in key


def test_a_damaged_precision_cache_is_measured_again(machine):
    machine(cpu_bf16=True)
    path = performance.precision_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    timings = Timings(194.0, 145.0)
    assert performance.resolve_precision(TrainConfig(), 0, measure=timings).reason == "measured"
    assert timings.calls == 1 and json.loads(path.read_text())


def test_a_multi_worker_run_does_not_measure(machine):
    machine(cpu_bf16=True)
    timings = Timings(194.0, 145.0)
    choice = performance.resolve_precision(TrainConfig(), 0, num_workers=2, measure=timings)
    assert (choice.precision, choice.reason, timings.calls) == ("mixed_bfloat16", "multi-worker", 0)


@pytest.mark.slow
def test_measuring_times_the_model_in_both_precisions_and_restores_float32():
    speeds = performance.measure_images_per_second(TrainConfig(model="tiny", batch_size=32))
    assert set(speeds) == {"float32", "mixed_bfloat16"}
    assert all(speed > 0 for speed in speeds.values())
    assert keras.mixed_precision.global_policy().name == "float32"
    # The kernel variants, timed the same way (in turns) in the precision asked.
    speeds = performance.measure_kernel_variants(TrainConfig(model="resnet8", batch_size=16), "mixed_bfloat16",
                                                 ["batchnorm"])  # fmt: skip
    assert set(speeds) == {"fused", "keras_batchnorm"} and all(speed > 0 for speed in speeds.values())
    assert keras.mixed_precision.global_policy().name == "float32"


def test_the_profiler_trace_of_a_training_step_names_its_convolutions(tmp_path):
    """bench/profile_step.py reads TF's profiler through cifar.compat (a private TF API, tied to the pin)."""
    from cifar import compat

    model = build_model("tiny", mean=[0.5] * 3, std=[0.25] * 3)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = np.zeros((8, 32, 32, 3), np.uint8), np.zeros(8, np.int32)
    model.train_on_batch(images, labels)
    tf.profiler.experimental.start(str(tmp_path))
    model.train_on_batch(images, labels)
    tf.profiler.experimental.stop()
    rows = compat.profiled_op_times(str(next(tmp_path.rglob("*.xplane.pb"))))
    types = {row["type"] for row in rows}
    assert any("Conv2DBackpropFilter" in name for name in types), types
    assert all(row["total_self_time"] >= 0 for row in rows)
