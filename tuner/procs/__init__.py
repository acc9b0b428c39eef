"""Candidates run outside the tuner's process: a restartable child (``child``), the isolated
measurer and the compile pool built on it, and the typed messages they exchange."""
