"""One exception hierarchy; the CLI turns any ``MoetuneError`` into one error line and exit 1."""


class MoetuneError(Exception):
    """Root of every error moetune raises on purpose."""


class DeviceError(MoetuneError):
    """A device that is not here: ``cuda`` on a machine without a GPU, or ``cuda:N`` beyond its
    GPUs."""


class ShapeError(MoetuneError):
    """A shape that cannot be tuned, imported or exported as given: an unknown preset, no shape
    or two, ``--buckets`` that are not token counts, vLLM files without the sizes or dtype
    their names leave out."""


class InvalidProblemError(ShapeError, ValueError):
    """A MoE shape or option that cannot describe a real layer (hidden size 0, topk > experts, ...)."""


class FormatError(MoetuneError):
    """A file moetune reads or writes besides its tables (vLLM's tuned-config JSON, aiter's
    CSV, a Hugging Face config.json, a misses file, a report) that is not in its format or
    cannot be read or written; or a ``--ceilings`` value that is not."""


class TableError(MoetuneError):
    """A table file that is missing, corrupt, not a moetune table, or written by a newer schema."""


class TableLockError(TableError):
    """A table file another process kept locked for longer than a writer waits for it."""


class UnknownKernelError(MoetuneError, KeyError):
    """A kernel name that is not in the registry."""


class InvalidParamsError(MoetuneError, ValueError):
    """Kernel parameters outside the kernel's declared space."""


class TuningError(MoetuneError):
    """The tuner could not produce a result (no eligible kernel, baseline failed, fewer GPUs
    than asked for, ...)."""


class WorkerDiedError(TuningError):
    """A child process measuring candidates died or timed out where its answer was needed
    (setting up a bucket, re-timing a finalist): the bucket fails, the job goes on."""


class UnsupportedModelError(ShapeError):
    """A model whose MoE layers use something moetune does not tune (expert biases, a clamped
    swiglu, a quantization scheme such as mxfp4 or fp8 with 64x64 blocks)."""
