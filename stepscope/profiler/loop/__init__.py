"""The training loop's records: its scopes (step, section, phase, loader) and finished steps."""
