"""Where Triton kernels run: compiled on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1). ``triton.jit`` reads that variable when a kernel is defined, so each
kernel module records it then and passes it here."""

from __future__ import annotations

from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import DType, MoEProblem


def interpreter_reason(problem: MoEProblem, sku: SKU, interpreted: bool) -> str | None:
    """Why Triton kernels defined with the interpreter on (``interpreted``) or off cannot run
    ``problem`` on ``sku``, or None."""
    if sku.vendor is Vendor.CPU:
        if not interpreted:
            return "Triton kernels need a GPU (TRITON_INTERPRET=1 runs them slowly on CPU)"
        if problem.dtype is DType.BFLOAT16:
            return "Triton's CPU interpreter computes bfloat16 wrong (numpy has no bfloat16)"
        return None
    if interpreted:
        return ("TRITON_INTERPRET=1 was set when the kernels were defined: they would run "
                "interpreted")
    return None
