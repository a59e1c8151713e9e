"""Change points: shifts are found where they are, noise and spikes say nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stepscope.analysis.stats.changepoints import ChangePointConfig, detect_change_points

CONFIG = ChangePointConfig()


def noisy(n: int, *, seed: int, level: float = 100.0, noise: float = 0.01) -> np.ndarray:
    """`n` samples at `level` with relative Gaussian noise."""
    return level * (1.0 + noise * np.random.default_rng(seed).standard_normal(n))


def test_level_drop_is_found_at_its_step_with_its_size() -> None:
    values = noisy(600, seed=1)
    values[300:] *= 0.95
    steps = np.arange(1000, 1600)

    (change,) = detect_change_points(values, steps, config=CONFIG)

    assert abs(change.step - 1300) <= 2
    assert change.index == change.step - 1000
    assert change.before == pytest.approx(100.0, rel=0.005)
    assert change.after == pytest.approx(95.0, rel=0.005)
    assert change.effect == pytest.approx(change.after / change.before - 1.0)
    assert change.effect == pytest.approx(-0.05, abs=0.005)
    assert change.statistic < 0
    assert change.p_value < 1e-9
    assert change.before_steps == change.index - CONFIG.warmup_steps
    assert change.after_steps == 600 - change.index


def test_two_percent_shift_at_one_percent_noise_is_found_within_five_steps() -> None:
    located = 0
    for seed in range(40):
        values = noisy(800, seed=seed)
        values[500:] *= 1.02
        changes = detect_change_points(values, config=CONFIG)
        located += any(abs(c.index - 500) <= 5 for c in changes)
    assert located >= 38


def test_shift_is_located_through_frequent_spikes() -> None:
    located = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        values = noisy(800, seed=seed)
        values[500:] *= 0.98
        spikes = rng.choice(np.arange(30, 800), size=30, replace=False)
        values[spikes] *= rng.choice([0.2, 0.5, 3.0], size=30)
        changes = detect_change_points(values, config=CONFIG)
        located += any(abs(c.index - 500) <= 5 for c in changes)
    assert located >= 36


def test_drop_then_recovery_gives_two_change_points_in_order() -> None:
    values = noisy(900, seed=2)
    values[300:600] *= 0.9

    changes = detect_change_points(values, config=CONFIG)

    assert [abs(c.index - at) <= 2 for c, at in zip(changes, (300, 600), strict=True)] == [
        True,
        True,
    ]
    assert changes[0].effect == pytest.approx(-0.10, abs=0.01)
    assert changes[1].effect == pytest.approx(1 / 0.9 - 1, abs=0.01)
    assert changes[0].after_steps == changes[1].index - changes[0].index
    assert changes[1].before_steps == changes[0].after_steps


@pytest.mark.parametrize("seed", range(30))
def test_pure_noise_gives_nothing(seed: int) -> None:
    assert detect_change_points(noisy(1500, seed=seed), config=CONFIG) == []


def test_autocorrelated_noise_gives_nothing() -> None:
    rng = np.random.default_rng(8)
    for _ in range(20):
        shocks = rng.standard_normal(1500)
        ar1 = np.empty_like(shocks)
        ar1[0] = shocks[0]
        for t in range(1, shocks.size):
            ar1[t] = 0.6 * ar1[t - 1] + 0.8 * shocks[t]
        assert detect_change_points(100.0 * (1.0 + 0.01 * ar1), config=CONFIG) == []


def test_single_spikes_and_short_bursts_give_nothing() -> None:
    for seed in range(10):
        values = noisy(1000, seed=100 + seed)
        rng = np.random.default_rng(seed)
        spikes = rng.choice(np.arange(30, 1000), size=15, replace=False)
        values[spikes] *= rng.choice([0.2, 0.5, 3.0], size=15)
        values[700:703] *= 0.3  # a three-step stall
        assert detect_change_points(values, config=CONFIG) == []


def test_random_mix_of_two_levels_gives_nothing() -> None:
    # A job of many ranks where some rank stalls in a good share of the steps: its step time
    # jumps between two levels at random, which is no change of level.
    for seed in range(20):
        rng = np.random.default_rng(200 + seed)
        values = noisy(1000, seed=300 + seed)
        stalled = rng.random(1000) < rng.uniform(0.05, 0.95)
        values[stalled] /= rng.choice([2.0, 3.0, 5.0])
        assert detect_change_points(values, config=CONFIG) == []


def test_shift_is_found_under_a_random_mix_of_two_levels() -> None:
    rng = np.random.default_rng(9)
    values = noisy(1000, seed=9)
    values[600:] *= 0.95
    values[rng.random(1000) < 0.4] /= 3.0

    (change,) = detect_change_points(values, config=CONFIG)

    assert abs(change.index - 600) <= 5
    assert change.effect == pytest.approx(-0.05, abs=0.01)


def test_excursion_shorter_than_min_segment_is_not_a_shift() -> None:
    values = noisy(600, seed=3)
    values[400 : 400 + CONFIG.min_segment_steps // 2] *= 0.8

    assert detect_change_points(values, config=CONFIG) == []


def test_warmup_steps_are_ignored() -> None:
    values = noisy(500, seed=4)
    values[: CONFIG.warmup_steps] *= np.linspace(0.3, 0.9, CONFIG.warmup_steps)

    assert detect_change_points(values, config=CONFIG) == []


def test_significant_shift_below_min_effect_is_not_reported() -> None:
    values = noisy(1000, seed=5, noise=0.0005)
    values[500:] *= 0.995

    assert detect_change_points(values, config=CONFIG) == []
    (change,) = detect_change_points(
        values, config=ChangePointConfig(min_effect=0.002, max_p_value=1e-3)
    )
    assert abs(change.index - 500) <= 2
    assert change.effect == pytest.approx(-0.005, abs=0.0005)


def test_noise_free_step_is_exact_and_non_finite_values_are_skipped() -> None:
    values = np.full(300, 2.0)
    values[200:] = 1.5
    values[[50, 120, 250]] = [math.nan, math.inf, math.nan]

    (change,) = detect_change_points(values, config=CONFIG)

    assert (change.index, change.step) == (200, 200)
    assert (change.before, change.after, change.effect) == (2.0, 1.5, -0.25)
    assert change.before_steps == 200 - CONFIG.warmup_steps - 2
    assert change.after_steps == 100 - 1


def test_constant_and_short_series_give_nothing() -> None:
    assert detect_change_points(np.full(500, 7.0), config=CONFIG) == []
    assert detect_change_points(noisy(50, seed=6), config=CONFIG) == []
    assert detect_change_points(np.array([]), config=CONFIG) == []


def test_max_change_points_keeps_the_strongest() -> None:
    values = noisy(1200, seed=7)
    values[300:] *= 0.9
    values[600:] *= 0.97
    values[900:] *= 0.7

    (change,) = detect_change_points(values, config=ChangePointConfig(max_change_points=1))

    assert abs(change.index - 900) <= 2


def test_steps_must_match_values() -> None:
    with pytest.raises(ValueError, match="shape"):
        detect_change_points(np.ones(10), np.arange(9), config=CONFIG)


@pytest.mark.parametrize(
    "bad",
    [
        {"warmup_steps": -1},
        {"min_effect": -0.1},
        {"min_segment_steps": 1},
        {"max_p_value": 0.0},
        {"max_p_value": 1.0},
        {"max_change_points": 0},
    ],
)
def test_config_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ChangePointConfig(**bad)  # type: ignore[arg-type]
