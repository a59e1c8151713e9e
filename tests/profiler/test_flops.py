"""FLOPs counting, the peak table and MFU."""

from __future__ import annotations

import math

import pytest

from stepscope.profiler.flops import PEAK_BF16_FLOPS, measure_flops, mfu, peak_flops_for


@pytest.mark.parametrize(
    ("device_name", "peak_flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GB200", 2500e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
    ],
)
def test_peak_flops_matches_names_as_torch_prints_them(device_name: str, peak_flops: float) -> None:
    assert peak_flops_for(device_name) == peak_flops


@pytest.mark.parametrize(
    "device_name", ["cpu", "", "NVIDIA L40", "NVIDIA A10G", "NVIDIA H100", "Tesla V100-SXM2-16GB"]
)
def test_unknown_devices_have_no_peak(device_name: str) -> None:
    assert peak_flops_for(device_name) is None


def test_every_table_entry_is_reachable_by_a_name_it_matches() -> None:
    # A pattern shadowed by an earlier, broader one would silently give the wrong peak.
    names = {
        r"\bGB200\b": "NVIDIA GB200",
        r"\bB200\b": "NVIDIA B200",
        r"\bGH200\b": "NVIDIA GH200 480GB",
        r"\bH200 NVL\b": "NVIDIA H200 NVL",
        r"\bH200\b": "NVIDIA H200",
        r"\bH100 NVL\b": "NVIDIA H100 NVL",
        r"\bH100 PCIe\b": "NVIDIA H100 PCIe",
        r"\bH100\b.*\b(HBM3|SXM5?)\b": "NVIDIA H100 SXM5 80GB",
        r"\bA100\b": "NVIDIA A100-PCIE-40GB",
        r"\bA40\b": "NVIDIA A40",
        r"\bA10\b": "NVIDIA A10",
        r"\bL40S\b": "NVIDIA L40S",
        r"\bL4\b": "NVIDIA L4",
        r"\bRTX 4090\b": "NVIDIA GeForce RTX 4090",
        r"\bMI325X\b": "AMD Instinct MI325X",
        r"\bMI300X\b": "AMD Instinct MI300X",
        r"\bMI250X\b": "AMD Instinct MI250X",
    }
    assert set(names) == set(PEAK_BF16_FLOPS)
    for pattern, name in names.items():
        assert peak_flops_for(name) == PEAK_BF16_FLOPS[pattern], name


def test_measured_flops_of_a_linear_training_step_are_six_b_in_out() -> None:
    torch = pytest.importorskip("torch")
    batch, d_in, d_out = 8, 32, 16
    model = torch.nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(batch, d_in, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()

    # forward 2·B·in·out, backward 2·B·in·out for the input grad + 2·B·in·out for the weight grad
    assert measure_flops(step) == 6 * batch * d_in * d_out


def test_forward_only_flops_are_two_b_in_out() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        flops = measure_flops(lambda: model(torch.randn(4, 64)))
    assert flops == 2 * 4 * 64 * 8


def test_mfu_is_achieved_over_peak() -> None:
    assert mfu(4.0e14, 1.0, 989e12) == pytest.approx(0.40445, rel=1e-4)
    assert mfu(1e12, 0.5, 4e12) == 0.5


@pytest.mark.parametrize(("step_s", "peak_flops"), [(0.0, 1e12), (-1.0, 1e12), (1.0, 0.0)])
def test_mfu_is_nan_without_a_positive_time_or_peak(step_s: float, peak_flops: float) -> None:
    assert math.isnan(mfu(1e12, step_s, peak_flops))
