"""`python -m stepscope.cli ARGS`."""

from stepscope.cli import main

main()
