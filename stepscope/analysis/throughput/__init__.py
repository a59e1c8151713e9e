"""Job throughput and MFU per step, their change points, and what caused them."""
