"""The CI regression gate around stepscope.analysis.regression.gate: which jobs (plan), steps
files (files) and the verdict's outputs (outputs)."""
