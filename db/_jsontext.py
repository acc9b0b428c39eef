"""Canonical JSON text for params and environments.

Params are part of a measurement's identity (a resumed job skips a ``(kernel, params)`` it has
already timed), so equal dicts must give byte-equal text: sorted keys, no whitespace. Text is
parsed with ``json.loads`` only; nothing stored in a table is ever executed or unpickled.
"""

import json
from collections.abc import Callable
from typing import Any

#: Bounds on stored JSON text: params, baselines and environments are a few hundred bytes, so
#: anything near these is damage, refused before (length) or while (depth) it is parsed.
MAX_JSON_CHARS = 1 << 20
MAX_JSON_DEPTH = 16


def dump_json(value: dict[str, Any]) -> str:
    """The canonical JSON text of a dict.

    Raises:
        TypeError: If ``value`` is not a dict or holds something JSON cannot represent.
        ValueError: If it holds NaN or infinity (not valid JSON, and never a valid parameter).
    """
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict, got {type(value).__name__}: {value!r}")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def load_json(text: object) -> dict[str, Any]:
    """Parse JSON text written by :func:`dump_json`.

    ``text`` may be any value a damaged table holds (NULL, a number, a blob): all are refused.

    Raises:
        ValueError: If ``text`` is not JSON text, longer than ``MAX_JSON_CHARS``, nested deeper
            than ``MAX_JSON_DEPTH``, or not a JSON object (``json.JSONDecodeError`` is a
            ``ValueError``); readers turn this into a skipped row, never a crash.
    """
    value = load_json_value(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def json_or_none(text: str | None,
                 parse: Callable[[str], dict[str, Any]] = load_json) -> dict[str, Any] | None:
    """A stored JSON object (read by ``parse``), or None where there is none or it cannot be
    parsed."""
    try:
        return None if text is None else parse(text)
    except ValueError:
        return None


def load_json_value(text: object) -> Any:
    """Any JSON value, within the bounds ``load_json`` states.

    Raises:
        ValueError: As ``load_json``, for anything but the object check.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected JSON text, got {type(text).__name__}")
    if len(text) > MAX_JSON_CHARS:
        raise ValueError(f"JSON text of {len(text)} characters, more than {MAX_JSON_CHARS}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (a scalar is 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            level.extend((c, depth + 1) for c in children)
    return deepest
