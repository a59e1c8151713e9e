"""The CI regression gate around stepscope.analysis.regression: job sources and outputs."""
