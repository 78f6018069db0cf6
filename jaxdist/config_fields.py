"""How a config field is declared: its default, one line of documentation and, for a
number, its valid range in interval notation (``jaxdist.config`` checks values against it;
``configs/README.md``'s key reference is generated from the same fields)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

# A number's valid range, in interval notation: "> 0", ">= 0", "[0, 1)", "(0, 1]", "any" (finite).
_RANGE = re.compile(r"^\s*(?:(>=|>)\s*(-?[\d.e+-]+)|([\[(])\s*(-?[\d.e+-]+)\s*,\s*(-?[\d.e+-]+)\s*([\])])|any)\s*$")


def knob(default: Any, doc: str, valid: str = "", *, factory: Any = None) -> Any:
    """A config field: its default, one line of documentation (the key reference's), and
    for numbers the valid range (``> 0``, ``>= 0``, ``[0, 1)``, ``(0, 1]``, ``any``)."""
    if valid and not _RANGE.match(valid):
        raise ValueError(f"bad range {valid!r}")
    metadata = {"doc": doc, "valid": valid}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def range_violation(value: float, valid: str) -> str | None:
    """Why ``value`` is outside ``valid`` (``knob``'s notation), or None when it is inside."""
    if not math.isfinite(value):
        return "must be a finite number"
    bound, low, opening, lo, hi, closing = _RANGE.match(valid).groups()
    if bound is not None:
        ok = value >= float(low) if bound == ">=" else value > float(low)
        return None if ok else f"must be {bound} {low}"
    if opening is None:  # "any": finite is enough
        return None
    above = value >= float(lo) if opening == "[" else value > float(lo)
    below = value <= float(hi) if closing == "]" else value < float(hi)
    return None if above and below else f"must be in {opening}{lo}, {hi}{closing}"
