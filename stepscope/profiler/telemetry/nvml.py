"""GPU telemetry: a daemon thread that samples one device through NVML (nvidia-ml-py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MIB = 1024 * 1024

# GPM metric ids (nvmlGpmMetricId_t) and how each becomes a schema.GPU column. The
# bandwidths come in MiB/s; activities are percentages, like `util`.
_GPM_COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL", 1.0),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 1.0),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL", 1.0),
    ("nvlink_tx_bps", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", _MIB),
    ("nvlink_rx_bps", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", _MIB),
    ("pcie_tx_bps", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", _MIB),
    ("pcie_rx_bps", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", _MIB),
)
GPM_COLUMNS = tuple(column for column, _, _ in _GPM_COLUMNS)


def host_gpu(local_rank: int, visible_devices: str | None) -> int | str | None:
    """The GPU a rank trains on as NVML names it: its index on the host, or its UUID; None
    when CUDA_VISIBLE_DEVICES names it in a way NVML cannot open (a MIG instance) or not at all.

    The rank's CUDA device is taken to be its local rank (torchrun's convention), or the only
    visible one. CUDA_VISIBLE_DEVICES (`visible_devices`) renumbers the CUDA devices a process
    sees, while NVML counts every GPU of the host: with "4,5,6,7", local rank 1 trains on host
    GPU 5. CUDA's numbering is taken to follow the PCI bus, as NVML's does (it does on nodes
    of one GPU model).
    """
    if visible_devices is None:
        return local_rank
    entries = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if len(entries) == 1:
        entry = entries[0]
    elif local_rank < len(entries):
        entry = entries[local_rank]
    else:
        return None
    if entry.isdigit():
        return int(entry)
    if entry.startswith("GPU-"):
        return entry
    return None


class GpuSampler:
    """Samples one GPU every `interval_s` and hands each row (schema.GPU wire columns) to `emit`.

    Build it with `create()`, which returns None where there is no NVML to sample.
    """

    def __init__(
        self,
        *,
        nvml: Any,
        handle: Any,
        gpu_index: int,
        interval_s: float,
        emit: Callable[[dict[str, Any]], None],
        gpm_supported: bool,
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self.gpu_index = gpu_index
        self.interval_s = interval_s
        self._emit = emit
        self.gpm_supported = gpm_supported
        self._gpm_samples: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def create(
        cls,
        *,
        interval_s: float = 1.0,
        device: int | str,
        emit: Callable[[dict[str, Any]], None],
    ) -> GpuSampler | None:
        """A sampler of the host's GPU `device` (an NVML index or UUID, see host_gpu()); None,
        logged once, without nvidia-ml-py, a driver, or that device."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        try:
            import pynvml
        except ImportError:
            logger.info(
                "GPU telemetry off: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            )
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            logger.info("GPU telemetry off: NVML is not available (%s)", exc)
            return None
        try:
            if isinstance(device, str):
                handle = pynvml.nvmlDeviceGetHandleByUUID(device)
                gpu_index = int(pynvml.nvmlDeviceGetIndex(handle))
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device)
                gpu_index = device
        except pynvml.NVMLError as exc:
            logger.info("GPU telemetry off: no NVML device %s (%s)", device, exc)
            pynvml.nvmlShutdown()
            return None
        return cls(
            nvml=pynvml,
            handle=handle,
            gpu_index=gpu_index,
            interval_s=interval_s,
            emit=emit,
            gpm_supported=_gpm_supported(pynvml, handle),
        )

    def uuid(self) -> str | None:
        """The device's NVML UUID ("GPU-..."): its identity across jobs, hosts and reboots."""
        value = _read(lambda: self._nvml.nvmlDeviceGetUUID(self._handle))
        if isinstance(value, bytes):
            return value.decode(errors="replace")
        return value if isinstance(value, str) else None

    def start(self) -> None:
        """Start the sampler thread; the first row comes one interval later."""
        if self._thread is not None or self._closed:
            return
        if self.gpm_supported:
            self._start_gpm()
        self._thread = threading.Thread(target=self._run, name="stepscope-gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (waiting at most `timeout_s`) and release NVML."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                # Still inside an NVML call: freeing its samples under it would be unsafe.
                return
        for gpm_sample in self._gpm_samples:
            _read(partial(self._nvml.nvmlGpmSampleFree, gpm_sample))
        self._gpm_samples = []
        _read(self._nvml.nvmlShutdown)

    def sample(self) -> dict[str, Any]:
        """One row of schema.GPU wire columns for now; a field NVML cannot read is None."""
        with self._lock:
            return self._sample()

    def _sample(self) -> dict[str, Any]:
        nvml, handle = self._nvml, self._handle
        utilization = _read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = _read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = _read(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        row: dict[str, Any] = {
            "ts": time.time(),
            "gpu_index": self.gpu_index,
            "util": _attr(utilization, "gpu", float),
            "mem_used_bytes": _attr(memory, "used", int),
            "mem_total_bytes": _attr(memory, "total", int),
            "power_w": None if power_mw is None else power_mw / 1000.0,
            "temp_c": _read(
                lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            ),
            "sm_clock_mhz": _read(
                lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            ),
            "throttle_reasons": self._throttle_reasons(),
        }
        row.update(self._gpm_row())
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._emit(self.sample())
            except Exception:
                logger.debug("GPU sample dropped", exc_info=True)

    def _throttle_reasons(self) -> int | None:
        # Clocks-event reasons is the newer name (driver 535+) of the same bitmask.
        for name in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        ):
            read = getattr(self._nvml, name, None)
            if read is not None:
                reasons = _read(partial(read, self._handle))
                if reasons is not None:
                    return int(reasons)
        return None

    def _start_gpm(self) -> None:
        nvml = self._nvml
        samples = [_read(nvml.nvmlGpmSampleAlloc), _read(nvml.nvmlGpmSampleAlloc)]
        self._gpm_samples = [s for s in samples if s is not None]
        if len(self._gpm_samples) < 2 or _read(lambda: self._take_gpm(0)) is None:
            logger.info("GPU telemetry: GPM metrics unavailable on device %d", self.gpu_index)
            self.gpm_supported = False

    def _take_gpm(self, slot: int) -> bool:
        self._nvml.nvmlGpmSampleGet(self._handle, self._gpm_samples[slot])
        return True

    def _gpm_row(self) -> dict[str, float | None]:
        row: dict[str, float | None] = dict.fromkeys(GPM_COLUMNS)
        if not self.gpm_supported or _read(lambda: self._take_gpm(1)) is None:
            return row
        nvml = self._nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_COLUMNS)
        request.sample1, request.sample2 = self._gpm_samples
        for i, (_, metric_name, _) in enumerate(_GPM_COLUMNS):
            request.metrics[i].metricId = getattr(nvml, metric_name)
        # The newer sample is the baseline of the next interval.
        self._gpm_samples.reverse()
        if _read(lambda: nvml.nvmlGpmMetricsGet(request)) is None:
            return row
        for i, (column, _, scale) in enumerate(_GPM_COLUMNS):
            metric = request.metrics[i]
            if metric.nvmlReturn == nvml.NVML_SUCCESS:
                row[column] = float(metric.value) * scale
        return row


def _gpm_supported(nvml: Any, handle: Any) -> bool:
    query = getattr(nvml, "nvmlGpmQueryDeviceSupport", None)
    support = _read(lambda: query(handle)) if query is not None else None
    return bool(getattr(support, "isSupportedDevice", False))


def _read(read: Callable[[], T]) -> T | None:
    """What `read` returns, or None when it raises: one unreadable metric costs one field."""
    try:
        return read()
    except Exception:
        logger.debug("NVML read failed", exc_info=True)
        return None


def _attr(value: Any, name: str, convert: Callable[[Any], T]) -> T | None:
    return None if value is None else _read(lambda: convert(getattr(value, name)))
