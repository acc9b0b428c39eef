"""Canonical JSON text for params and environments.

Params are part of a measurement's identity (a resumed job skips a ``(kernel, params)`` it has
already timed), so equal dicts must give byte-equal text: sorted keys, no whitespace. Text is
parsed with ``json.loads`` only; nothing stored in a table is ever executed or unpickled.
"""

import json
from typing import Any


def dump_json(value: dict[str, Any]) -> str:
    """The canonical JSON text of a dict.

    Raises:
        TypeError: If ``value`` is not a dict or holds something JSON cannot represent.
        ValueError: If it holds NaN or infinity (not valid JSON, and never a valid parameter).
    """
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict, got {type(value).__name__}: {value!r}")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def load_json(text: str) -> dict[str, Any]:
    """Parse JSON text written by :func:`dump_json`.

    Raises:
        ValueError: If ``text`` is not JSON or not a JSON object (``json.JSONDecodeError`` is a
            ``ValueError``); readers turn this into a skipped row, never a crash.
    """
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value
