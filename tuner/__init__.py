"""Offline search: inputs, timing, the correctness gate, Optuna studies per bucket, the CLI."""
