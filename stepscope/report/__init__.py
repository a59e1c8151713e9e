"""Self-contained reports of stored jobs: figures and HTML."""
