"""Hardware profiles: the data files in ``jaxdist/plan/hardware/`` and ``cpu-local``.

A profile says what one device sustains (matmul FLOP/s, memory bandwidth), the links a
collective can cross (within a node, across nodes) and two scheduling facts (fused
attention, how much of a loop's compute can hide its collectives). The GPU profiles are
vendors' datasheet figures with the efficiency factors their files explain; ``cpu-local``
is this host, measured on the spot (``jaxdist.plan.measure``): its "devices" are fake CPU
devices or processes that share the host's cores.

Kernel rates the GPU pricing of a compiled XLA:GPU program needs (``plan.cost``), defaults here,
overridable per profile: fp8 GEMMs at twice the bf16 peak from compute capability 8.9 on (the H100
datasheet's 1,979 dense FP8 TFLOP/s; none before: an A100 has no fp8 tensor cores) at the same
sustained share; cuDNN flash attention at a share of the sustained matmul rate (FlashAttention-3,
Shah et al. 2024, figs. 5-6: cuDNN on an H100 SXM5 at head dim 128 and 2K-16K tokens sustains
about 600 TFLOP/s forward and 500 backward beside about 740 for large bf16 GEMMs).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import yaml

from jaxdist.errors import JaxdistError

PROFILE_DIR = Path(__file__).parent / "hardware"
CPU_LOCAL = "cpu-local"


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one device sends, each direction
    latency: float  # seconds per step of a ring
    efficiency: float = 1.0  # sustained / nominal bandwidth


@dataclasses.dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    peak_flops: float  # per device, the MFU denominator
    matmul_efficiency: float  # sustained matmul FLOP/s / peak
    memory_bytes: float
    memory_bandwidth: float
    memory_efficiency: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    fused_attention: bool
    overlap: float  # share of a loop's compute that can hide the loop's collectives
    shared_host: bool = False  # cpu-local: the devices share one host's cores
    sources: tuple[str, ...] = ()
    op_overhead_s: float = 0.0  # per executed op (XLA:CPU's dispatch); GPUs: launches hide behind the queue
    matmul_curve: tuple[tuple[float, float], ...] = ()  # (FLOPs per call, FLOP/s): small matmuls run slower
    device: dict | None = None  # GPUs: the device facts a compile-only target is described by (plan.gpu_target)
    fp8_peak_flops: float = 0.0  # dense fp8 peak; 0: twice peak_flops from compute capability 8.9 on, else no fp8
    attention_fwd_share: float = 0.80  # cuDNN flash attention's forward FLOP/s / the sustained matmul rate
    attention_bwd_share: float = 0.67  # and its backward's
    host_link: Link | None = None  # device <-> pinned host memory (PCIe), per GPU and direction: what offloaded values cross

    def matmul_rate(self, flops_per_call: float) -> float:
        """Sustained FLOP/s of one matmul of this size (log-log interpolation of the curve)."""
        curve = sorted(self.matmul_curve)
        if not curve:
            return self.matmul_flops_per_s
        if flops_per_call <= curve[0][0]:
            return curve[0][1]
        for (f0, r0), (f1, r1) in zip(curve, curve[1:], strict=False):
            if flops_per_call <= f1:
                w = (math.log(flops_per_call) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
        return curve[-1][1]

    @property
    def matmul_flops_per_s(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    @property
    def compute_capability(self) -> tuple[int, int]:
        major, _, minor = str((self.device or {}).get("compute_capability", "0.0")).partition(".")
        return int(major), int(minor or 0)

    @property
    def fp8_flops_per_s(self) -> float:
        """Sustained fp8 GEMM FLOP/s; the bf16 rate where the device has no fp8 tensor cores."""
        peak = self.fp8_peak_flops or (2 * self.peak_flops if self.compute_capability >= (8, 9) else 0.0)
        return peak * self.matmul_efficiency if peak else self.matmul_flops_per_s


def default_hardware(platform: str, device_kind: str) -> str | None:
    """The planner profile these devices are: a GPU by its kind, this host's ``cpu-local`` on CPU."""
    if platform == "cpu":
        return CPU_LOCAL
    kind = device_kind.upper()
    return next((key for key in ("h200", "h100", "a100") if key.upper() in kind), None)


def profiles() -> list[str]:
    return sorted([*(p.stem for p in PROFILE_DIR.glob("*.yaml")), CPU_LOCAL])


def load_hardware(key: str, *, gpus_per_node: int | None = None) -> Hardware:
    """The profile called ``key`` (``h100``, ``h200``, ``a100``, ``h100-hbm2e``, ``cpu-local``)."""
    if key == CPU_LOCAL:
        hardware = cpu_local()
    else:
        path = PROFILE_DIR / f"{key}.yaml"
        if not path.is_file():
            raise JaxdistError(f"unknown hardware {key!r} (profiles: {', '.join(profiles())})")
        data = yaml.safe_load(path.read_text())

        def numbers(d: dict) -> dict:  # YAML 1.1 reads "80.0e9" as a string
            return {k: (float(v) if isinstance(v, str) and k not in ("name",) else v) for k, v in d.items()}

        data = numbers({k: v for k, v in data.items() if k not in ("sources", "device")}) | {
            "sources": data.get("sources", ()),
            "device": data.get("device"),
        }
        data["intra_node"], data["inter_node"] = Link(**numbers(data["intra_node"])), Link(**numbers(data["inter_node"]))
        if "host_link" in data:
            data["host_link"] = Link(**numbers(data["host_link"]))
        data["sources"] = tuple(data.get("sources", ()))
        hardware = Hardware(key=key, **data)
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise JaxdistError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
        hardware = dataclasses.replace(hardware, gpus_per_node=gpus_per_node)
    return hardware


def cpu_local(profile: dict | None = None) -> Hardware:
    """This host as a profile: fp32 (XLA:CPU's compute dtype), its measured matmul rates (by
    size) and the bandwidth its memory-bound fusions sustain, fake devices (one process) as the "node" and gloo between processes
    as the link across nodes. No fused attention and no overlap on XLA:CPU."""
    if profile is None:
        # measure imports JAX, and this module is read before the platform is chosen (plan.gpu_target)
        from jaxdist.plan.measure import load_or_measure

        profile = load_or_measure()

    def link(prefix: str) -> Link:  # the fit is per all-reduce of 2 devices: 2 ring steps
        return Link(profile[f"{prefix}bytes_per_s"], profile[f"{prefix}latency_s"] / 2)

    return Hardware(
        key=CPU_LOCAL,
        name=f"this host ({profile.get('host', '?')})",
        peak_flops=profile["matmul_flops_per_s"],
        matmul_efficiency=1.0,
        memory_bytes=_host_memory(),
        memory_bandwidth=profile.get("fusion_bytes_per_s", profile["memory_bytes_per_s"]),  # what real fusions sustain
        memory_efficiency=1.0,
        gpus_per_node=1 << 30,  # one process holds all its fake devices; set per run
        intra_node=link("fake_device_collective_"),
        inter_node=link("collective_"),
        fused_attention=False,
        overlap=0.0,
        shared_host=True,
        op_overhead_s=profile.get("op_overhead_s", 0.0),
        matmul_curve=tuple(tuple(p) for p in profile.get("matmul_curve", ())),
        sources=(f"measured {profile.get('measured_at', '?')} by python -m jaxdist.plan.measure",),
    )


def _host_memory() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9


def memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator may take (``XLA_PYTHON_CLIENT_MEM_FRACTION``, JAX's default 0.75)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        return 0.75


def allowed_memory(hardware: Hardware) -> float:
    """Bytes a program may peak at on one device of ``hardware`` (what JAX's allocator may take): the fit rule."""
    return memory_fraction() * hardware.memory_bytes
