"""What the device and model tell: NVML samples, FLOPs and MFU, deep captures, preflight checks."""
