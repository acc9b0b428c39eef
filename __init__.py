"""moetune: measured, per-GPU dispatch tables for Mixture-of-Experts kernels.

Layers import one way: ``db`` <- ``runtime`` <- ``tuner``.
"""

__version__ = "0.1.0"
