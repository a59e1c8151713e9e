"""`stepscope run`: the launcher that runs a training command with the job's environment."""
