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


_URL_USER = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s]+@")


def credentials_violation(value: Any) -> str | None:
    """Why a string value may not be used: a URL with a user part (``s3://KEY:SECRET@bucket``)."""
    if isinstance(value, str) and _URL_USER.match(value):
        return "names credentials in its URL (they would be written into config.yaml): set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
    return None
