"""One exception hierarchy; the CLI turns any ``MoetuneError`` into one error line and exit 1."""


class MoetuneError(Exception):
    """Root of every error moetune raises on purpose."""


class InvalidProblemError(MoetuneError, ValueError):
    """A MoE shape or option that cannot describe a real layer (hidden size 0, topk > experts, ...)."""


class TableError(MoetuneError):
    """A table file that is missing, corrupt, not a moetune table, or written by a newer schema."""


class TableLockError(TableError):
    """A table file another process kept locked for longer than a writer waits for it."""


class UnknownKernelError(MoetuneError, KeyError):
    """A kernel name that is not in the registry."""


class InvalidParamsError(MoetuneError, ValueError):
    """Kernel parameters outside the kernel's declared space."""


class TuningError(MoetuneError):
    """The tuner could not produce a result (no eligible kernel, baseline failed, ...)."""


class UnsupportedModelError(MoetuneError):
    """A model whose MoE layers use something moetune does not tune (expert biases, a clamped
    swiglu, a quantization scheme such as mxfp4 or fp8 with 64x64 blocks)."""
