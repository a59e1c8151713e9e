"""The profiler's OTLP export (otlp_endpoint), received by stepscope's own /v1/metrics."""

from __future__ import annotations

import time

import orjson
import pytest

import stepscope
from tests.live_server import RunningServer, read_rows

NUM_STEPS, TOKENS = 12, 512
GPU_SAMPLE = {
    "ts": 1.8e9,
    "gpu_index": 0,
    "util": 87.0,
    "mem_used_bytes": 10 * 2**30,
    "mem_total_bytes": 80 * 2**30,
    "power_w": 412.5,
    "temp_c": 65.0,
}


def test_the_otlp_export_round_trips_into_the_receiver_with_equal_values(
    live_server: RunningServer,
) -> None:
    prof = stepscope.init(
        job_id="otlp-out",
        url=live_server.url,
        otlp_endpoint=f"{live_server.url}/v1/metrics",
        tokens_per_step=TOKENS,
        flops_per_step=1e9,
        peak_flops=1e12,
        flush_interval_s=0.2,
    )
    for x in prof.wrap_dataloader(range(NUM_STEPS)):
        with prof.step():
            time.sleep(0.01 + 0.001 * x)
    # No GPU here: one sample, as the NVML sampler hands it to the shipper.
    prof.shipper.add("gpu", GPU_SAMPLE)
    prof.close()

    steps = read_rows(live_server.db_url, "steps", "otlp-out")
    assert len(steps) == NUM_STEPS
    step_s = [r["step_s"] for r in steps]
    points = read_rows(live_server.db_url, "otlp_metrics", "otlp-out")
    assert {p["rank"] for p in points} == {0}
    latest = {p["name"]: p for p in sorted(points, key=lambda p: p["ts"])}
    duration = latest["stepscope.step.duration"]
    assert duration["kind"] == "histogram"
    assert duration["unit"] == "s"
    assert duration["count"] == NUM_STEPS
    assert duration["value"] == pytest.approx(sum(step_s), rel=1e-12)
    assert (duration["min"], duration["max"]) == (min(step_s), max(step_s))
    counts = duration["bucket_counts"]
    assert sum(orjson.loads(counts) if isinstance(counts, str) else counts) == NUM_STEPS
    assert latest["stepscope.steps"]["value"] == NUM_STEPS
    assert latest["stepscope.tokens"]["value"] == NUM_STEPS * TOKENS
    # Gauges hold the last batch's figures: they lie between the extremes of the steps.
    assert 1e9 / max(step_s) / 1e12 <= latest["stepscope.mfu"]["value"] <= 1e9 / min(step_s) / 1e12
    throughput = latest["stepscope.throughput.tokens_per_s"]["value"]
    assert TOKENS / max(step_s) <= throughput <= TOKENS / min(step_s)
    assert 0 < latest["stepscope.step.data_share"]["value"] < 1
    # The GPU gauges (hw.gpu.*, hw.power, hw.temperature) land in the GPU table, beside the
    # native sample, at the export's time: the same values.
    gpu = read_rows(live_server.db_url, "gpu_samples", "otlp-out")
    relayed = [r for r in gpu if r["ts"] != GPU_SAMPLE["ts"]]
    assert relayed
    for row in relayed:
        assert {k: row[k] for k in GPU_SAMPLE if k != "ts"} == {
            k: v for k, v in GPU_SAMPLE.items() if k != "ts"
        }


def test_an_unreachable_otlp_endpoint_never_reaches_training(live_server: RunningServer) -> None:
    prof = stepscope.init(
        job_id="otlp-down",
        url=live_server.url,
        otlp_endpoint="http://127.0.0.1:9/v1/metrics",
        flush_interval_s=0.2,
        close_timeout_s=1.0,
    )
    for _ in prof.wrap_dataloader(range(3)):
        with prof.step():
            time.sleep(0.005)
    prof.close()
    assert len(read_rows(live_server.db_url, "steps", "otlp-down")) == 3
