"""Stepscope's words: labels of finding kinds, causes and components, numbers with units,
findings as sentences. Stdlib and `stepscope.schema` only; the CLI, dashboard, report, API
and webhooks all say things through here."""
