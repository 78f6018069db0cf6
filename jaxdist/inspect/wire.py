"""Which devices a compiled collective spans, which mesh axes that is, and how many bytes
each device puts on the wire for it.

XLA prints a collective's participants in one of four forms, all handled here:

    replica_groups={{0,1},{2,3}}                      explicit groups ({} = every device)
    replica_groups=[2,4]<=[8]  /  [4,2]<=[2,4]T(1,0)  iota: arange, reshape, transpose, then rows
    replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}       Shardy mesh axes, optionally
        with device_ids=([2,4]T(1,0)) giving the devices in mesh order
    source_target_pairs={{0,1},{1,0}}                 collective-permute

Device numbers are partition ids: positions in the executable's device assignment, which
for a jaxdist step is ``mesh.devices.flat``; so partition ``i`` sits at
``np.unravel_index(i, mesh.shape)``.

Wire bytes per device per execution, for a group of ``n`` devices and the full buffer ``B``
(the larger of operand and result), as a bandwidth-optimal ring moves them:
all-reduce 2(n-1)/n B; all-gather, reduce-scatter and all-to-all (n-1)/n B;
collective-broadcast (n-1)/n B (averaged over the group); collective-permute and send B;
recv 0 (the sender counts those bytes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

_EXPLICIT_RE = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA_RE = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}")
_GROUP_RE = re.compile(r"\{([\d,\s]*)\}")
_MESH_AXIS_RE = re.compile(r"'([^']+)'\s*=\s*(\d+)")

RING_FACTOR = {  # wire bytes = factor(n) x buffer bytes
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-broadcast": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def device_groups(attributes: str, num_devices: int | None) -> list[list[int]] | None:
    """The participant groups of one collective, or None when the text names none we know
    (or says "every device" and ``num_devices`` is unknown)."""
    match = _MESH_RE.search(attributes)
    if match:
        axes = _MESH_AXIS_RE.findall(match.group(1))
        sizes = [int(size) for _, size in axes]
        names = [name for name, _ in axes]
        ids = np.arange(math.prod(sizes))
        if match.group(2):
            ids = _iota(_ints(match.group(2)), _ints(match.group(3)) if match.group(3) else None).reshape(-1)
        grid = ids.reshape(sizes)
        spanned = [names.index(name) for name in re.findall(r"'([^']+)'", match.group(4))]
        kept = [i for i in range(len(sizes)) if i not in spanned]
        grid = grid.transpose(kept + spanned)
        return grid.reshape(-1, math.prod(sizes[i] for i in spanned)).tolist()
    match = _IOTA_RE.search(attributes)
    if match:
        shape = _ints(match.group(1))
        ids = _iota(_ints(match.group(2)), _ints(match.group(3)) if match.group(3) else None)
        return ids.reshape(shape[0], -1).tolist()
    match = _PAIRS_RE.search(attributes)
    if match:
        return [_ints(g) for g in _GROUP_RE.findall(match.group(1))]
    match = _EXPLICIT_RE.search(attributes)
    if match:
        groups = [_ints(g) for g in _GROUP_RE.findall(match.group(1))]
        groups = [g for g in groups if g]
        if groups:
            return groups
    if num_devices:  # no groups printed, or {}: every device is in one group
        return [list(range(num_devices))]
    return None


def group_size(kind: str, groups: list[list[int]] | None) -> int | None:
    if not groups:
        return None
    if kind == "collective-permute":  # pairs: the ring size is the number of distinct devices
        return len({d for pair in groups for d in pair})
    return max(len(g) for g in groups)


def spanned_axes(groups: list[list[int]] | None, mesh_shape: dict[str, int] | None) -> tuple[str, ...] | None:
    """Mesh axes along which members of a group differ (in mesh order); () for groups of one."""
    if not groups or not mesh_shape:
        return None
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if max(d for g in groups for d in g) >= math.prod(sizes):
        return None
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [members, axes]
        varying |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return tuple(name for name in names if name in varying)


def wire_bytes(kind: str, buffer_bytes: int, n: int | None) -> int | None:
    """Bytes one device sends for one execution, by the ring formulas; None if ``n`` is unknown."""
    if kind in ("collective-permute", "send", "recv"):
        return round(buffer_bytes * RING_FACTOR[kind](1))
    if n is None:
        return None
    return round(buffer_bytes * RING_FACTOR[kind](n)) if n > 1 else 0
