"""Calibration: how many tokens/s this service sustains, how stable its latency is, how much it holds."""
