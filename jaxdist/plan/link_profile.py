"""Link profiles: what ``python -m jaxdist.commbench --out PATH`` measured, in a form the
planner reads instead of a profile's datasheet links (``python -m jaxdist.plan --links PATH``).

The format follows the ``cpu-local`` profile's collectives (``jaxdist.plan.measure``): per
link, the all-reduce points ``[buffer bytes per device, median seconds]`` and the fit
``time = latency + wire_bytes / bandwidth`` over them, with ``wire_bytes = 2 (n - 1) / n x
buffer`` (what one device sends in a ring; the same as nccl-tests' bus bytes). The planner's
``Link`` takes the bandwidth as it is (efficiency 1: it was sustained, not quoted) and the
latency per ring step (the fit's latency over the 2 (n - 1) steps of an all-reduce).

    {"format": "jaxdist-link-profile", "version": 1, "host": ..., "measured_at": ..., "mesh": {...},
     "links": {"intra_node": {"latency_s", "bytes_per_s", "group_size", "axis", "all_reduce": [[bytes, s], ...]},
               "inter_node": {...}},
     "results": [one row per axis x collective x size, as commbench printed them]}

A file is data only: parsed as JSON, every field checked; a bad one is one line (JaxdistError).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxdist.errors import JaxdistError
from jaxdist.plan.cost import ring_steps
from jaxdist.plan.hardware import Hardware, Link, default_hardware
from jaxdist.plan.measure import fit_latency_bandwidth, ring_wire_bytes

FORMAT = "jaxdist-link-profile"
VERSION = 1
LINKS = ("intra_node", "inter_node")  # the planner's Hardware fields

log = logging.getLogger(__name__)


def fit_links(rows: Sequence[dict[str, Any]], *, left_out: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per link, the latency/bandwidth fit of the all-reduce rows of the largest axis on it
    (``rows``: commbench's results). A link whose points show no bandwidth is left out, in one
    warning line (or, given ``left_out``, appended to it as "the LINK link (AXIS) ...: why")."""
    links: dict[str, dict[str, Any]] = {}
    for link in LINKS:
        axes = {(r["group_size"], r["axis"]) for r in rows if r["link"] == link and r["kind"] == "all-reduce"}
        if not axes:
            continue
        n, axis = max(axes, key=lambda na: (na[0], na[1]))
        points = [[float(r["bytes"]), float(r["time_s"])] for r in rows if r["axis"] == axis and r["kind"] == "all-reduce"]
        try:
            latency, bandwidth = fit_latency_bandwidth([(ring_wire_bytes(b, n), t) for b, t in points])
        except ValueError:
            sizes = sorted({int(b) for b, _ in points})
            why = (
                "one size gives no bandwidth"
                if len(sizes) < 2
                else f"its all-reduce time does not grow with size from {sizes[0]} to {sizes[-1]} bytes (latency-bound or noisy)"
            )
            reason = f"the {link} link ({axis}) is left out of the profile: {why}"
            if left_out is not None:
                left_out.append(reason)
            else:
                log.warning(f"{reason}; measure a wider range of --sizes")
            continue
        links[link] = {"latency_s": latency, "bytes_per_s": bandwidth, "group_size": n, "axis": axis, "all_reduce": points}
    return links


def link_profile(report: dict[str, Any], *, left_out: list[str] | None = None) -> dict[str, Any]:
    """The file commbench writes for ``report`` (``jaxdist.plan.link_bench.run_commbench``'s)."""
    header = {k: report[k] for k in ("host", "cores", "jax_version", "platform", "device_kind", "devices", "processes", "mesh")}
    header |= {k: report[k] for k in ("dtype", "iters", "warmup", "threads", "measured_at")}
    links = fit_links(report["results"], left_out=left_out)
    return {"format": FORMAT, "version": VERSION, **header, "links": links, "results": report["results"]}


def read_link_profile(path: str | Path) -> dict[str, Link]:
    """The measured links of a commbench profile file, as the planner's ``Link``s."""
    return load_link_profile(path)[0]


def load_link_profile(path: str | Path) -> tuple[dict[str, Link], dict[str, Any]]:
    """(the measured links of a commbench profile file as the planner's ``Link``s, the file's
    other fields: where and on what they were measured)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise JaxdistError(f"--links {path}: cannot read it ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JaxdistError(f"--links {path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise JaxdistError(
            f'--links {path}: not a link profile (expected "format": "{FORMAT}"; python -m jaxdist.commbench --out PATH writes one)'
        )
    if data.get("version") != VERSION:
        raise JaxdistError(f"--links {path}: version {data.get('version')!r}, this jaxdist reads version {VERSION}")
    links = data.get("links")
    if not isinstance(links, dict) or not links:
        raise JaxdistError(f"--links {path}: no measured link (a mesh axis of more than one device with all-reduce rows)")
    out = {}
    for name, link in links.items():
        if name not in LINKS:
            raise JaxdistError(f"--links {path}: unknown link {name!r} (links: {', '.join(LINKS)})")
        if not isinstance(link, dict):
            raise JaxdistError(f"--links {path}: link {name!r} is not an object")
        latency, bandwidth, n = link.get("latency_s"), link.get("bytes_per_s"), link.get("group_size")
        if not (_number(latency) and latency >= 0 and _number(bandwidth) and bandwidth > 0):
            raise JaxdistError(f"--links {path}: link {name!r} needs latency_s >= 0 and bytes_per_s > 0, got {latency!r}, {bandwidth!r}")
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 2):
            raise JaxdistError(f"--links {path}: link {name!r} needs group_size >= 2, got {n!r}")
        out[name] = Link(bandwidth=float(bandwidth), latency=float(latency) / ring_steps("all-reduce", n), efficiency=1.0)
    return out, {k: v for k, v in data.items() if k not in ("links", "results")}


def measured_elsewhere(header: dict[str, Any], hardware: Hardware) -> str | None:
    """What the links were measured on, when that is not the devices ``hardware`` describes
    (CPU links for a GPU plan, another GPU's): one line's worth; None when they match or the file does not say."""
    platform, kind = header.get("platform"), header.get("device_kind")
    if not isinstance(platform, str) or not isinstance(kind, str):
        return None
    measured = default_hardware(platform, kind)
    if measured is not None and (hardware.key == measured or hardware.key.startswith(f"{measured}-")):
        return None
    devices = header.get("devices")
    what = f"{devices if isinstance(devices, int) else ''} {platform} devices".strip() + ("" if kind.lower() == platform else f" ({kind})")
    return f"measured on {what}, not on the plan's {hardware.name}"


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def with_links(hardware: Hardware, links: dict[str, Link], source: str) -> Hardware:
    """``hardware`` with its measured links in place of the datasheet's (the others kept)."""
    return dataclasses.replace(hardware, **links, sources=(*hardware.sources, f"links {', '.join(sorted(links))} measured: {source}"))
