"""Deep captures: a torch.profiler trace read for its top operators."""
