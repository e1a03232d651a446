"""Speed settings: precision and XLA resolution per device kind, the bf16 CPU check, and that
bfloat16 training with the fused batch norm still learns."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from cifar import performance
from cifar.config import TrainConfig
from cifar.data.synthetic import make_split
from cifar.models import build_model

CPUINFO_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep avx2 avx512f avx512bw"


@pytest.fixture(autouse=True)
def float32_policy_afterwards():
    """configure_performance sets a global policy; every test leaves float32 behind."""
    yield
    keras.mixed_precision.set_global_policy("float32")


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
        (True, [], 0, "mixed_bfloat16"),  # Sapphire Rapids and newer: AMX.
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
    assert performance.resolve_precision(TrainConfig(precision="auto"), num_gpus) == expected


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_explicit_precision_is_kept(machine, precision):
    machine(cpu_bf16=False, gpus=[(8, 0)])
    for num_gpus in (0, 1):
        assert performance.resolve_precision(TrainConfig(precision=precision), num_gpus) == precision


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


def test_configure_performance_sets_the_policy_and_reports_strings(machine):
    machine(cpu_bf16=True)
    settings = performance.configure_performance(TrainConfig(precision="auto", jit_compile="auto"), 0)
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    assert settings["precision"] == "mixed_bfloat16"
    assert settings["jit_compile"] == "false"
    assert settings["device"] == "cpu"
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in settings.items())

    machine(cpu_bf16=False, gpus=[(7, 0)])
    settings = performance.configure_performance(TrainConfig(precision="auto"), 1)
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    assert (settings["precision"], settings["jit_compile"], settings["device"]) == ("mixed_float16", "true", "gpu x1")


def test_configure_performance_rejects_negative_threads():
    with pytest.raises(ValueError):
        performance.configure_performance(TrainConfig(precision="float32"), 0, intra_op_threads=-1)


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
