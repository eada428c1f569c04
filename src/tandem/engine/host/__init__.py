"""Choices measured on the host at load: precision and its probe, quality probe and gate, INT4
calibration, batch invariance, thread counts."""
