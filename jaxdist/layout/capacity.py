"""Expert capacity: the rows an expert (or a device's all-to-all buffer) holds, in exact
arithmetic. Pure Python: the validator sizes buffers with it before JAX starts, and the
expert kernels size their arrays with the same functions."""

from __future__ import annotations

import math
from fractions import Fraction


def ceil_scaled(rows: int, factor: float, divisor: int) -> int:
    """ceil(rows x factor / divisor), at least 1, in exact rational arithmetic. ``factor`` is read
    as the decimal it is written as (``Fraction(repr(factor))``: 1.1 is 11/10), since a config value
    comes from text: a float product such as 50 x 1.1 = 55.00000000000001 (or the binary value of
    1.1, a hair above 11/10) would otherwise round up to a spurious extra row."""
    return max(1, math.ceil(Fraction(rows) * Fraction(repr(float(factor))) / divisor))


def capacity_rows(tokens: int, top_k: int, n_experts: int, factor: float) -> int | None:
    """Rows an expert takes from ``tokens`` tokens: ceil(tokens x k / experts x factor) (exact,
    ``ceil_scaled``); None (no limit) when ``factor <= 0`` (dropless)."""
    if factor <= 0:
        return None
    return ceil_scaled(tokens * top_k, factor, n_experts)
