"""The CI regression gate's statistics: baselines, per-metric and share tests, attribution."""
