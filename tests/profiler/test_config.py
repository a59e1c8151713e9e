from __future__ import annotations

import pytest

from stepscope.profiler.config import Config, build_config, default_flush_interval_s, detect_env


def test_env_vars_fill_every_kind_of_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSCOPE_URL", "http://collector:8000")
    monkeypatch.setenv("STEPSCOPE_TOKEN", "tok")
    monkeypatch.setenv("STEPSCOPE_JOB_ID", "job-7")
    monkeypatch.setenv("STEPSCOPE_TOKENS_PER_STEP", "4096")
    monkeypatch.setenv("STEPSCOPE_FLOPS_PER_STEP", "auto")
    monkeypatch.setenv("STEPSCOPE_PEAK_FLOPS", "9.89e14")
    monkeypatch.setenv("STEPSCOPE_FLUSH_INTERVAL_S", "0.5")
    monkeypatch.setenv("STEPSCOPE_ATTRIBUTES", '{"git_sha": "abc"}')
    monkeypatch.setenv("STEPSCOPE_PATCH_COLLECTIVES", "0")
    monkeypatch.setenv("STEPSCOPE_COMM_TIMING", "bucket")
    config = build_config()
    assert config.url == "http://collector:8000"
    assert config.token == "tok"
    assert config.job_id == "job-7"
    assert config.tokens_per_step == 4096
    assert config.flops_per_step == "auto"
    assert config.peak_flops == 9.89e14
    assert config.flush_interval_s == 0.5
    assert config.attributes == {"git_sha": "abc"}
    assert config.patch_collectives is False
    assert config.comm_timing == "bucket"
    assert config.enabled


def test_arguments_win_over_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSCOPE_URL", "http://from-env:1")
    monkeypatch.setenv("STEPSCOPE_FLOPS_PER_STEP", "1e12")
    config = build_config(url="http://from-arg:2", flops_per_step=None)
    assert config.url == "http://from-arg:2"
    assert config.flops_per_step == 1e12


@pytest.mark.parametrize(("env", "enabled"), [({}, False), ({"STEPSCOPE_DISABLED": "1"}, False)])
def test_disabled_without_url_or_when_told(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], enabled: bool
) -> None:
    monkeypatch.delenv("STEPSCOPE_URL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    url = "http://x:1" if env else None
    assert build_config(url=url).enabled is enabled


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("flush_interval_s", 0.0),
        ("max_buffer_rows", 0),
        ("flops_per_step", "lots"),
        ("peak_flops", -1.0),
        ("comm_timing", "sometimes"),
        ("url", "collector:8000"),
        ("url", "ftp://collector/"),
        ("url", "http://collector:port"),
        ("relay_url", "http://"),
    ],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})  # type: ignore[arg-type]


def test_unknown_option_is_refused() -> None:
    with pytest.raises(TypeError, match="flush_interval"):
        build_config(flush_interval=1.0)


def test_torchrun_variables() -> None:
    env = detect_env(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "GROUP_RANK": "2",
            "TORCHELASTIC_RUN_ID": "run-42",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (5, 1, 8, 2)
    assert env.job_id == "run-42"
    assert env.node


def test_slurm_variables() -> None:
    env = detect_env(
        {
            "SLURM_JOB_ID": "991",
            "SLURM_PROCID": "17",
            "SLURM_LOCALID": "3",
            "SLURM_NTASKS": "32",
            "SLURM_NODEID": "4",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (17, 3, 32, 4)
    assert env.job_id == "slurm-991"


def test_torchrun_without_run_id_and_a_single_process() -> None:
    env = detect_env({"TORCHELASTIC_RUN_ID": "none"})
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (0, 0, 1, None)
    assert env.job_id is None


def test_default_flush_interval_grows_with_world_size() -> None:
    assert Config().flush_interval_s is None
    sizes = (1, 512, 1024, 4096, 65536)
    assert [default_flush_interval_s(n) for n in sizes] == [2.0, 2.0, 4.0, 16.0, 30.0]
