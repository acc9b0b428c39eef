"""Which pick of which vLLM a winner was timed against: the typed values that carry a row's
baselines from the tuner through the table to serving, and their JSON form.

A speedup means something only next to what it was measured over. Each rule variant a winner
was timed beside is a ``BaselineRecord``: the kernel and params that ran (``Candidate``), the
vLLM release whose pick they stand for and the tuned-config file the config came from. Whether
a stored variant is today's rule (``BaselineRecord.stands_for``) is decided here and nowhere
else, so serving, ``show``, reports, merges and the tuner cannot disagree.

Stored as ``{"schema": 2, "variants": [...]}`` (``dump_baselines``). Schema 1, written before
variants named their vLLM, has no ``schema`` key; its variants read as migration
``0007_baseline_vllm`` rewrites them (``SCHEMA1_VLLM``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any, Protocol

from moetune.db._jsontext import dump_json

#: The version of the JSON form ``dump_baselines`` writes.
SCHEMA = 2
#: The vLLM a schema-1 variant stands for, by kernel: every one was timed in vLLM 0.32's days,
#: ``aiter_triton`` as moetune's emulation of its Triton pick with its configs,
#: ``vllm_cpu_experts`` as its CPU kernel; other kernels (the torch loop) stand for no vLLM.
SCHEMA1_VLLM = {"aiter_triton": "0.32.0", "vllm_cpu_experts": "0.32.0"}
_VERSION = re.compile(r"(\d+)\.(\d+)")
_TIMES = ("median_us", "p20_us", "p80_us")
_RATIOS = ("ratio_lo", "ratio_hi")
_COUNTS = ("rounds", "disturbed")


def params_key(params: dict[str, Any]) -> str:
    """Canonical JSON of a parameter set, as tables store it (``dump_json``): the identity
    used for comparison, de-duplication and storage (``{"a": 1}`` and ``{"a": True}`` differ,
    as they do to a kernel)."""
    return dump_json(params)


def minor_version(version: str | None) -> str | None:
    """``"0.34.1"`` -> ``"0.34"``: the part of a vLLM version its picks depend on (moetune
    supports vLLM per minor release); None for None or text that is no version."""
    match = _VERSION.match(version) if isinstance(version, str) else None
    return f"{match[1]}.{match[2]}" if match else None


class Pick(Protocol):
    """What a baseline may stand for: a rule's choice (``runtime.rules.RuleChoice``) or another
    row's baseline. ``vllm`` and ``configs`` None: the pick does not depend on them."""

    @property
    def kernel(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]: ...

    @property
    def vllm(self) -> str | None: ...

    @property
    def configs(self) -> str | None: ...


@dataclasses.dataclass(frozen=True, eq=False)
class Candidate:
    """A kernel with its params: equal, and hashed, by ``key`` (params as canonical JSON), so
    it works as a dict key where a dict of params cannot."""

    kernel: str
    params: dict[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return self.kernel, params_key(self.params)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Candidate) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return f"{self.kernel} {params_key(self.params)}"


@dataclasses.dataclass(frozen=True)
class BaselineRecord:
    """One rule variant timed beside a winner in its confirmation.

    Attributes:
        candidate: What ran.
        vllm: The vLLM version whose pick it stands for (``"0.34.0"``); None where it stands
            for no vLLM (the torch loop, the rule without vLLM).
        configs: The vLLM tuned-config file(s) its config came from, ``"default"`` for vLLM's
            default heuristic; None where that does not apply or is not known.
        median_us, p20_us, p80_us: Its pooled time in the confirmation.
        rounds: Rounds clean for it and the winner, over which ``ratio_lo``-``ratio_hi``, the
            interval of the winner's speedup over it, was taken (None for both bounds where
            they say nothing; rows from before schema 0003 have neither).
        beaten: The winner's speedup over it lies above the margin.
        disturbed: Rounds left out as disturbed (None: the row did not record it).
    """

    candidate: Candidate
    vllm: str | None = None
    configs: str | None = None
    median_us: float | None = None
    p20_us: float | None = None
    p80_us: float | None = None
    rounds: int | None = None
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    beaten: bool = False
    disturbed: int | None = None

    @property
    def kernel(self) -> str:
        return self.candidate.kernel

    @property
    def params(self) -> dict[str, Any]:
        return self.candidate.params

    def stands_for(self, pick: Pick) -> bool:
        """Whether this is ``pick``'s variant, timed: ``why_not`` has nothing to say."""
        return self.why_not(pick) is None

    def why_not(self, pick: Pick) -> str | None:
        """Why this variant is not ``pick``, or None where it is: the kernel and params must
        match; where ``pick`` names a vLLM, the same minor release (a patch release picks the
        same); where it names configs, the same configs."""
        if self.candidate != Candidate(pick.kernel, pick.params):
            return f"timed against {self.candidate}, the rule here is {pick.kernel} " \
                   f"{params_key(pick.params)}"
        if pick.vllm is not None and minor_version(self.vllm) != minor_version(pick.vllm):
            return f"timed against {vllm_label(self.vllm)} pick, the rule here is " \
                   f"{vllm_label(pick.vllm)}"
        if pick.configs is not None and self.configs != pick.configs:
            return f"timed against the config from {self.configs or 'unknown configs'}, the " \
                   f"rule here takes it from {pick.configs}"
        return None

    def to_json(self) -> dict[str, Any]:
        """The variant as schema 2 stores it."""
        return {"kernel": self.kernel, "params": self.params, "vllm": self.vllm,
                "configs": self.configs, **{f: getattr(self, f) for f in (
                    *_TIMES, *_COUNTS, *_RATIOS)}, "beaten": self.beaten}

    @classmethod
    def from_json(cls, value: object, schema: int = SCHEMA) -> BaselineRecord:
        """A stored variant of JSON form ``schema`` (1: its vLLM from ``SCHEMA1_VLLM``).

        Raises:
            ValueError: ``value`` is not an object with a kernel name and a params object, a
                time is not a finite positive number, a count not a non-negative integer, a
                bound not a number, ``beaten`` not a boolean, or ``vllm`` or ``configs`` is
                not text (``vllm`` a version).
        """
        if not isinstance(value, dict):
            raise ValueError("not an object")
        kernel, params = value.get("kernel"), value.get("params")
        if not isinstance(kernel, str) or not kernel or not isinstance(params, dict):
            raise ValueError("no kernel name or no params object")
        for name in _TIMES:
            if value.get(name) is not None and not _positive(value[name]):
                raise ValueError(f"{name} is {_short(value[name])}, not a finite positive "
                                 "number")
        for name in _COUNTS:
            count = value.get(name)
            if count is not None and not (_integer(count) and count >= 0):
                raise ValueError(f"{name} is {_short(count)}, not a count")
        for name in _RATIOS:
            if value.get(name) is not None and not _number(value[name]):
                raise ValueError(f"{name} is {_short(value[name])}, not a number")
        if not isinstance(value.get("beaten", False), bool):
            raise ValueError(f"beaten is {_short(value['beaten'])}, not true or false")
        if schema == 1:
            vllm, configs = SCHEMA1_VLLM.get(kernel), None
        else:
            vllm, configs = value.get("vllm"), value.get("configs")
        if vllm is not None and minor_version(vllm) is None:
            raise ValueError(f"vllm is {_short(vllm)}, not a version")
        if configs is not None and not isinstance(configs, str):
            raise ValueError(f"configs is {_short(configs)}, not text")
        return cls(Candidate(kernel, params), vllm, configs,
                   **{f: value.get(f) for f in (*_TIMES, *_COUNTS, *_RATIOS)},
                   beaten=value.get("beaten", False))


def dump_baselines(records: Iterable[BaselineRecord]) -> str:
    """The stored text of a row's variants (canonical JSON, schema ``SCHEMA``)."""
    return dump_json({"schema": SCHEMA, "variants": [r.to_json() for r in records]})


def vllm_label(version: str | None) -> str:
    """``"0.32.0"`` -> ``"vLLM 0.32's"``, as reasons name whose pick a variant is."""
    minor = minor_version(version)
    return f"vLLM {minor}'s" if minor else "no vLLM's"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    return _number(value) and math.isfinite(value) and value > 0  # type: ignore[arg-type]


def _short(value: object) -> str:
    """``value`` as a reason shows it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
