"""GpuSampler: NVML values become schema.GPU columns in SI units; no driver means no sampler."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import sys
import time
import types
from typing import Any

import pytest

import stepscope
from stepscope import schema
from stepscope.profiler.telemetry.nvml import GpuSampler, host_gpu
from tests.live_server import RunningServer, read_rows
from tests.support import require

GIB = 1024**3
MIB = 1024**2
LOGGER = "stepscope.profiler.telemetry.nvml"


def _real_pynvml() -> Any:
    require(importlib.util.find_spec("pynvml") is not None, "nvidia-ml-py (stepscope[gpu])")
    import pynvml

    return pynvml


class FakeNvml(types.SimpleNamespace):
    """pynvml with the real constants, error classes and ctypes structs, and scripted readings."""

    def __init__(self, *, gpm_supported: bool = False) -> None:
        real = _real_pynvml()
        super().__init__(
            **{
                k: getattr(real, k)
                for k in dir(real)
                if k.startswith(("NVML", "c_nvml", "struct_c_nvml"))
            }
        )
        self.calls: list[str] = []
        self.gpm_supported = gpm_supported
        self.gpm_requests: list[tuple[int, int]] = []
        self.gpm_values: dict[int, float] = {}
        self.gpm_unsupported_ids: set[int] = set()
        self._gpm_structs: list[Any] = []
        self.readings: dict[str, Any] = {
            "util": types.SimpleNamespace(gpu=87, memory=40),
            "memory": types.SimpleNamespace(total=80 * GIB, used=10 * GIB, free=70 * GIB),
            "power_mw": 412_345,
            "temp": 65,
            "sm_clock": 1980,
            "event_reasons": 0x4,
            "throttle_reasons": 0x8,
        }

    def _value(self, key: str) -> Any:
        value = self.readings[key]
        if isinstance(value, BaseException):
            raise value
        return value

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle-{index}"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return f"GPU-0000-{handle}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if not uuid.startswith("GPU-0000-handle-"):
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return uuid.removeprefix("GPU-0000-")

    def nvmlDeviceGetIndex(self, handle: str) -> int:
        return int(handle.removeprefix("handle-"))

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return self._value("util")

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return self._value("memory")

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return int(self._value("power_mw"))

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return int(self._value("temp"))

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return int(self._value("sm_clock"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        return int(self._value("event_reasons"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        return int(self._value("throttle_reasons"))

    def nvmlGpmQueryDeviceSupport(self, handle: str) -> Any:
        return types.SimpleNamespace(isSupportedDevice=int(self.gpm_supported))

    def nvmlGpmSampleAlloc(self) -> Any:
        # A real sample handle pointing at a distinct struct, so tests can tell them apart.
        struct = self.struct_c_nvmlGpmSample_t()
        self._gpm_structs.append(struct)
        return self.c_nvmlGpmSample_t(struct)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.calls.append("gpm_free")

    def nvmlGpmSampleGet(self, handle: str, sample: Any) -> Any:
        self.calls.append("gpm_sample")
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self.gpm_requests.append(
            (ctypes.addressof(request.sample1.contents), ctypes.addressof(request.sample2.contents))
        )
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in self.gpm_unsupported_ids:
                metric.nvmlReturn = self.NVML_ERROR_NOT_SUPPORTED
            else:
                metric.nvmlReturn = self.NVML_SUCCESS
                metric.value = self.gpm_values[metric.metricId]
        return request


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def _sampler(emit: Any = None, interval_s: float = 1.0) -> GpuSampler:
    sampler = GpuSampler.create(interval_s=interval_s, device=3, emit=emit or (lambda row: None))
    assert sampler is not None
    return sampler


def test_sample_converts_nvml_readings_to_si_units(fake_nvml: FakeNvml) -> None:
    before = time.time()
    row = _sampler().sample()

    assert before <= row["ts"] <= time.time()
    assert row["gpu_index"] == 3
    assert row["util"] == 87.0
    assert row["mem_used_bytes"] == 10 * GIB
    assert row["mem_total_bytes"] == 80 * GIB
    assert row["power_w"] == pytest.approx(412.345)
    assert row["temp_c"] == 65.0
    assert row["sm_clock_mhz"] == 1980.0
    assert row["throttle_reasons"] == 0x4
    assert {k: row[k] for k in ("sm_active", "tensor_active", "nvlink_tx_bps")} == dict.fromkeys(
        ("sm_active", "tensor_active", "nvlink_tx_bps")
    )


def test_row_has_exactly_the_gpu_wire_columns(fake_nvml: FakeNvml) -> None:
    row = _sampler().sample()
    assert set(row) == {column.name for column in schema.GPU.wire_columns}


def test_a_failed_read_costs_only_its_field(fake_nvml: FakeNvml) -> None:
    fake_nvml.readings["power_mw"] = fake_nvml.NVMLError(fake_nvml.NVML_ERROR_NOT_SUPPORTED)
    fake_nvml.readings["memory"] = RuntimeError("driver hiccup")
    row = _sampler().sample()

    assert row["power_w"] is None
    assert row["mem_used_bytes"] is None
    assert row["mem_total_bytes"] is None
    assert row["util"] == 87.0
    assert row["temp_c"] == 65.0


def test_throttle_reasons_fall_back_to_the_older_call(fake_nvml: FakeNvml) -> None:
    fake_nvml.readings["event_reasons"] = fake_nvml.NVMLError(
        fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    assert _sampler().sample()["throttle_reasons"] == 0x8

    fake_nvml.readings["throttle_reasons"] = fake_nvml.NVMLError(fake_nvml.NVML_ERROR_UNKNOWN)
    assert _sampler().sample()["throttle_reasons"] is None


def test_gpm_metrics_become_percent_and_bytes_per_second(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpm_supported = True
    fake_nvml.gpm_values = {
        fake_nvml.NVML_GPM_METRIC_SM_UTIL: 55.5,
        fake_nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 41.0,
        fake_nvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 30.25,
        fake_nvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 1000.0,
        fake_nvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 2000.0,
        fake_nvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 12.5,
    }
    fake_nvml.gpm_unsupported_ids = {fake_nvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC}
    sampler = _sampler()
    assert sampler.gpm_supported
    sampler.start()  # takes the baseline GPM sample
    try:
        row = sampler.sample()
        second = sampler.sample()
    finally:
        sampler.stop()

    assert row["sm_active"] == 55.5
    assert row["tensor_active"] == 41.0
    assert row["dram_active"] == 30.25
    assert row["nvlink_tx_bps"] == 1000.0 * MIB
    assert row["nvlink_rx_bps"] == 2000.0 * MIB
    assert row["pcie_tx_bps"] == 12.5 * MIB
    assert row["pcie_rx_bps"] is None
    assert second["sm_active"] == 55.5
    # Each interval is measured from the previous sample, not from the start.
    (a, b), (c, d) = fake_nvml.gpm_requests
    assert a != b
    assert (c, d) == (b, a)
    assert fake_nvml.calls.count("gpm_free") == 2


def test_unsupported_gpm_leaves_its_columns_null(fake_nvml: FakeNvml) -> None:
    sampler = _sampler()
    sampler.start()
    try:
        row = sampler.sample()
    finally:
        sampler.stop()
    assert not sampler.gpm_supported
    assert row["dram_active"] is None
    assert row["pcie_tx_bps"] is None
    assert "gpm_sample" not in fake_nvml.calls


def test_thread_emits_a_row_every_interval_until_stopped(fake_nvml: FakeNvml) -> None:
    rows: list[dict[str, Any]] = []
    sampler = _sampler(rows.append, interval_s=0.02)
    sampler.start()
    deadline = time.monotonic() + 5.0
    while len(rows) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop(timeout_s=2.0)
    num_rows = len(rows)
    time.sleep(0.1)

    assert num_rows >= 3
    assert len(rows) == num_rows
    assert [r["ts"] for r in rows] == sorted(r["ts"] for r in rows)
    assert all(r["power_w"] == pytest.approx(412.345) for r in rows)
    assert fake_nvml.calls.count("shutdown") == 1
    sampler.stop()
    assert fake_nvml.calls.count("shutdown") == 1


def test_an_emit_that_raises_does_not_stop_sampling(fake_nvml: FakeNvml) -> None:
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        if len(rows) == 1:
            raise RuntimeError("shipper buffer closed")

    sampler = _sampler(emit, interval_s=0.02)
    sampler.start()
    deadline = time.monotonic() + 5.0
    while len(rows) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(rows) >= 3


@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [
        (3, None, 3),  # every GPU visible: CUDA's numbering is the host's
        (1, "4,5,6,7", 5),  # the node's second job: host GPUs 4 to 7
        (2, " 4, 5 ,6,7", 6),
        (5, "2", 2),  # one GPU per task (Slurm): the only visible one, whatever the rank
        (1, "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),
        (0, "MIG-1234", None),  # a MIG instance: NVML cannot open it by that name
        (4, "0,1", None),
        (0, "", None),  # no GPU visible
    ],
)
def test_the_sampled_gpu_is_the_one_cuda_visible_devices_gives_the_rank(
    local_rank: int, visible: str | None, expected: int | str | None
) -> None:
    assert host_gpu(local_rank, visible) == expected


def test_a_gpu_named_by_uuid_is_sampled_under_its_host_index(fake_nvml: FakeNvml) -> None:
    sampler = GpuSampler.create(device="GPU-0000-handle-6", emit=lambda row: None)
    assert sampler is not None
    assert sampler.gpu_index == 6
    assert sampler.sample()["gpu_index"] == 6
    assert sampler.uuid() == "GPU-0000-handle-6"


def test_a_rank_of_the_nodes_second_job_samples_its_own_gpu(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, live_server: RunningServer
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("LOCAL_RANK", "1")
    prof = stepscope.init(job_id="nvml-visible", url=live_server.url, gpu_interval_s=0.05)
    time.sleep(0.5)  # ~10 samples
    prof.close()
    rows = read_rows(live_server.db_url, "gpu_samples", "nvml-visible")
    assert rows
    assert {row["gpu_index"] for row in rows} == {5}


def test_missing_device_index_gives_no_sampler(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_device(index: int) -> str:
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_INVALID_ARGUMENT)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetHandleByIndex", no_device)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert GpuSampler.create(device=7, emit=lambda row: None) is None
    assert len(caplog.records) == 1
    assert "no NVML device 7" in caplog.text
    assert fake_nvml.calls == ["init", "shutdown"]


def test_without_nvidia_ml_py_there_is_no_sampler_and_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert GpuSampler.create(device=0, emit=lambda row: None) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "nvidia-ml-py is not installed" in caplog.text


def test_without_a_driver_there_is_no_sampler_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pynvml = _real_pynvml()
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("an NVIDIA driver is installed here; this test is for machines without one")
    assert isinstance(pynvml.NVMLError_LibraryNotFound, type)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert GpuSampler.create(device=0, emit=lambda row: None) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "NVML is not available" in caplog.text
    assert "Shared Library Not Found" in caplog.text


def test_interval_must_be_positive(fake_nvml: FakeNvml) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        GpuSampler.create(interval_s=0, device=0, emit=lambda row: None)


def test_the_device_is_named_by_its_nvml_uuid(fake_nvml: FakeNvml) -> None:
    assert _sampler().uuid() == "GPU-0000-handle-3"


def test_an_unreadable_uuid_is_none(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(handle: str) -> str:
        raise fake_nvml.NVMLError(fake_nvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetUUID", broken)
    assert _sampler().uuid() is None
