"""``python -m jaxdist.plan``: rank the layouts of a training job on N GPUs by predicted step time.

    python -m jaxdist.plan --config llama3-8b --gpus 8 --hardware h100 [--gpus-per-node 8] [--links PATH]
        [--global-batch B] [--top K] [--time-budget S] [--max-compiles K] [--json] [key=value ...]

Every (data, fsdp, expert, context, tensor, pipe) x microbatches x remat (none, save_matmuls,
full; for a GPU target also offload_layer_inputs, and the optimizer state in host memory beside
the full-remat forms) (x context strategy: all_gather, ring, all_to_all) layout jaxdist accepts is screened (an expert axis only for an MoE
model; a rough time orders them), then the best are compiled, best first, until ``--time-budget`` seconds or
``--max-compiles`` compiles. For a GPU profile each is compiled by XLA:GPU for N compile-only
devices of the target (``plan.gpu_target``; ``--gpus-per-node`` per host): the screen keeps the
layouts whose estimated memory is within ``search.PREFILTER_MARGIN`` of what JAX may allocate,
and XLA:GPU's peak memory decides what fits. For ``cpu-local`` they are compiled against N fake
CPU devices, after a screen that must fit with 10% headroom. Each compiled step is priced by
``jaxdist.plan.cost`` on the hardware profile (``--links PATH``: its links as ``python -m jaxdist.commbench --out PATH`` measured
them, ``jaxdist.plan.link_profile``). Compiles are cached, so a rerun is fast. Each runs in a child
process (``plan.compile_worker``): a layout whose compile aborts XLA is left out in one line. ``--json`` prints
``{"candidates": [...]}`` best first, each with ``mesh``, ``microbatches``, ``remat``, ``optimizer_offload``,
``collective_matmul``, ``context_strategy``, ``step_time_s``, ``tokens_per_sec_per_device``, ``mfu``,
``memory_per_device_bytes`` and ``bound``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence

from tqdm import tqdm

import jaxdist
from jaxdist import errors
from jaxdist.cli import parse_args
from jaxdist.config import load_config
from jaxdist.errors import EXIT_OK, JaxdistError, OneLineArgumentParser
from jaxdist.layout import devices
from jaxdist.plan import hardware as hardware_profiles
from jaxdist.plan.compile_worker import CompileWorker
from jaxdist.plan.gpu_target import TARGETS, allowed_memory, prepare_target

GIB = 2**30

log = logging.getLogger("jaxdist.plan")  # not __name__: run as -m it is __main__, outside jaxdist's logger
# plan(), _gpu_target() and _price() import the modules that import JAX themselves: this one is
# imported before main() chooses the platform (prepare_compiler).


def build_arg_parser():
    parser = OneLineArgumentParser(prog="python -m jaxdist.plan", description="Rank training layouts by predicted step time.")
    parser.add_argument("--config", default=None, help="preset or YAML (default: the built-in tiny model)")
    parser.add_argument("--gpus", type=int, required=True, help="devices to plan for")
    parser.add_argument("--hardware", required=True, help="h100 | h200 | a100 | h100-hbm2e | cpu-local")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the profile's)")
    parser.add_argument(
        "--links", default=None, metavar="PATH", help="measured links (python -m jaxdist.commbench --out PATH) for the datasheet's"
    )
    parser.add_argument("--global-batch", type=int, default=None, help="train.global_batch (sequences per step)")
    parser.add_argument(
        "--schedules",
        default="",
        metavar="LIST",
        help="pipeline schedules to search on a pipe axis, comma-separated (gpipe, circular, 1f1b, interleaved, zb1, zbv) or all; "
        "default: parallel.schedule's alone",
    )
    parser.add_argument("--top", type=int, default=5, help="candidates to print")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds of compiling, at most")
    parser.add_argument("--max-compiles", type=int, default=12, help="layouts to compile, at most")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--log-level", default="info", choices=jaxdist.LEVELS, help="what reaches stderr (default info)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def check_limits(args) -> None:
    """Raise (one line) for a limit that would make the search empty or meaningless."""
    for flag, value in (("--gpus", args.gpus), ("--max-compiles", args.max_compiles), ("--top", args.top)):
        if value < 1:
            raise JaxdistError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise JaxdistError(f"{flag} must be >= 1, got {value}")
    if not args.time_budget > 0:  # also NaN
        raise JaxdistError(f"--time-budget must be > 0 seconds, got {args.time_budget:g}")


def plan(args) -> dict:
    from jaxdist.models.counts import count_params
    from jaxdist.plan.link_profile import load_link_profile, measured_elsewhere, with_links
    from jaxdist.plan.search import (
        CONTEXT_STRATEGIES,
        HEADROOM,
        OFFLOAD_REMATS,
        PREFILTER_MARGIN,
        REMATS,
        enumerate_candidates,
        estimated_memory,
        estimated_time,
    )

    check_limits(args)
    overrides = list(args.overrides)
    if args.global_batch is not None:
        overrides.append(f"train.global_batch={args.global_batch}")
    hardware = hardware_profiles.load_hardware(args.hardware, gpus_per_node=args.gpus_per_node)
    if getattr(args, "links", None):
        links, measured = load_link_profile(args.links)
        elsewhere = measured_elsewhere(measured, hardware)
        if elsewhere:  # e.g. fake CPU devices' links pricing an H100 plan: legal, but the numbers are not the plan's
            log.warning(f"--links {args.links} was {elsewhere}: its links price this plan's collectives")
        hardware = with_links(hardware, links, args.links)
        for missing in sorted({"intra_node", "inter_node"} - set(links)):
            log.warning(f"--links {args.links} measured no {missing} link; the profile's datasheet figure prices it")
    overrides.append(f"model.dtype={'float32' if hardware.shared_host else 'bfloat16'}")  # what the device computes in
    overrides.append("data.source=synthetic")  # a plan reads no data
    config = load_config(args.config, overrides)
    if config.model.kind != "llama":
        raise JaxdistError("the planner prices language models (model.kind=llama)")
    if config.parallel.context_strategy not in CONTEXT_STRATEGIES:  # the search tries each of them; a typo is still an error
        raise JaxdistError(
            f"parallel.context_strategy must be one of {', '.join(CONTEXT_STRATEGIES)}, got {config.parallel.context_strategy!r}"
        )
    if config.model.vocab_size == 0:
        config.model.vocab_size = 128 * 256  # the tokenizer decides at run time; a 32K vocab for planning
    n_params = count_params(config.model)
    per_node = min(hardware.gpus_per_node, args.gpus)
    rejected: Counter = Counter()
    offload = hardware.host_link is not None and not hardware.shared_host and devices.cuda_plugin_installed()
    schedules = searched_schedules(getattr(args, "schedules", ""))
    remats = REMATS + OFFLOAD_REMATS if offload else REMATS
    candidates = enumerate_candidates(config, args.gpus, per_node, rejected, remats, offload, schedules)
    if not candidates and len(rejected) == 1:  # every layout fails the same way: the config itself is wrong
        raise JaxdistError(next(iter(rejected)))
    if not candidates:
        raise JaxdistError(
            f"no layout of {config.name} uses {args.gpus} GPUs: data x fsdp must divide the global batch "
            f"({config.train.global_batch}), tensor the heads ({config.model.n_heads}/{config.model.n_kv_heads}) within a node "
            f"({per_node}), pipe the layers ({config.model.n_layers}), 2 x context the sequence ({config.train.seq_len})"
        )
    target = _gpu_target(hardware, args.gpus, per_node)
    if target is not None:  # XLA:GPU's peak decides; the estimate only screens out the hopeless
        usable = allowed_memory(hardware)
        budget, usable_text = PREFILTER_MARGIN * usable, f"{usable / GIB:.1f} GiB usable ({PREFILTER_MARGIN:g}x that for the estimate)"
    else:
        budget = HEADROOM * hardware.memory_bytes
        usable_text = f"{budget / GIB:.1f} GiB usable"
    screened = [(c, estimated_memory(config, c, n_params, hardware.fused_attention)) for c in candidates]
    fitting = [(c, m) for c, m in screened if m <= budget]
    if not fitting:
        smallest, need = min(screened, key=lambda cm: cm[1])
        raise JaxdistError(
            f"{config.name} fits no layout on {args.gpus} x {hardware.name}: the smallest ({smallest.label()}) needs "
            f"{need / GIB:.1f} GiB per device, {usable_text}; use more GPUs or a smaller train.global_batch"
        )
    rough = {c: estimated_time(config, c, n_params, hardware) for c, _ in fitting}
    fitting.sort(key=lambda cm: rough[cm[0]])
    fitting = compile_order(fitting)
    result = _price(config, fitting, hardware, args, target, rough)
    result["layouts"]["valid"] = len(candidates)
    return result


def searched_schedules(text: str) -> tuple[str, ...]:
    """``--schedules``' names (all of them for ``all``; none: the config's schedule alone)."""
    from jaxdist.plan.search import PIPELINE_SCHEDULES

    names = PIPELINE_SCHEDULES if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PIPELINE_SCHEDULES]
    if unknown:
        raise JaxdistError(f"--schedules: {', '.join(unknown)} is not a pipeline schedule ({', '.join(PIPELINE_SCHEDULES)} or all)")
    return names


def pipeline_name(config, candidate) -> str | None:
    """The schedule a layout with a pipe axis runs, as ``--schedules`` names it (interleaved 1F1B apart from 1F1B)."""
    from jaxdist.plan.search import candidate_pipeline

    spec = candidate_pipeline(config, candidate)
    return None if spec is None else ("interleaved" if spec.interleaved else spec.schedule)


def compile_order(ranked: list[tuple]) -> list[tuple]:
    """``ranked`` ((candidate, estimate) in rough time order) with the best of each remat policy and optimizer placement
    first: the rough time favours keeping every activation, and its first dozen were all ``none``
    (llama3-8b's ``fsdp=8`` with ``save_matmuls``, faster in XLA:GPU's program, went uncompiled).
    A compiled layout that does not fit hands its place to the next of its kind (``_price``)."""
    firsts: dict[tuple[str, bool], int] = {}
    for i, (candidate, _) in enumerate(ranked):
        firsts.setdefault(memory_kind(candidate), i)
    return [ranked[i] for i in sorted(firsts.values())] + [x for i, x in enumerate(ranked) if i not in firsts.values()]


def memory_kind(candidate) -> tuple[str, bool]:
    """What a layout keeps for the backward and where its optimizer state lives."""
    return candidate.remat, candidate.optimizer_offload


def reranked(rest: list[tuple], rough: dict, speed: dict[tuple[str, bool], float]) -> list[tuple]:
    """``rest`` ordered by the rough time scaled by what the compiles of its memory kind showed
    (``speed``: the smallest compiled step over rough time among its layouts that fit). The rough
    time ranks keeping every activation first, but near the memory limit XLA rematerializes on its
    own and its scheduler overlaps less: llama3-8b's ``fsdp=8`` with ``save_matmuls`` (0.87 s in
    XLA:GPU's program) ranked below a dozen rough-faster ``none`` layouts (1.0 s and slower) and went
    uncompiled. A kind no compile has priced yet takes the slowest factor seen."""
    unseen = max(speed.values(), default=1.0)
    return sorted(rest, key=lambda item: rough.get(item[0], math.inf) * speed.get(memory_kind(item[0]), unseen))


def refined(step: str, fitted: list[tuple], config) -> tuple | None:
    """The fastest compiled layout that fits (``fitted``: (step time, candidate, estimate)) changed by ``step``, to compile
    next: ``collective_matmul`` where it has a tensor axis and the key composes with it, ``scan_layers`` its layers in a loop
    (the fastest without collective matmuls)."""
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.layout.validate import check_config_on_mesh
    from jaxdist.plan.search import configured

    if step == "scan_layers":  # not a collective-matmul layout: XLA:GPU took over 20 CPU-minutes on llama3-70b's rings unrolled
        fitted = [f for f in fitted if not f[1].collective_matmul]
    if not fitted:
        return None
    _, best, estimate = min(fitted, key=lambda f: f[0])
    if step == "scan_layers":
        return dataclasses.replace(best, scan_layers=False), estimate
    twin = dataclasses.replace(best, collective_matmul=True)
    if best.sizes["tensor"] == 1 or best.collective_matmul:
        return None
    try:
        check_config_on_mesh(configured(config, twin), parse_mesh(twin.mesh_spec))
    except JaxdistError:
        return None
    return twin, estimate


def _gpu_target(hardware, gpus: int, per_node: int):
    """What a plan for ``hardware`` compiles for: XLA:GPU's program for ``gpus`` devices of the
    target (None: XLA:CPU's, on fake CPU devices: ``cpu-local``, or, said in one line, a GPU
    profile on a machine without JAX's CUDA plugin)."""
    from jaxdist.plan.search import GpuTarget

    if hardware.shared_host:
        return None
    if not devices.cuda_plugin_installed():
        log.warning(
            f"JAX's CUDA plugin is not installed: each layout is compiled against fake CPU devices and "
            f"priced for {hardware.name} by rule, not from XLA:GPU's program (pip install -e '.[dev]')"
        )
        return None
    if gpus > per_node and gpus % per_node:
        raise JaxdistError(f"--gpus {gpus} is not a whole number of nodes of {per_node} (--gpus-per-node)")
    return GpuTarget(hardware, gpus, per_node)


def _price(config, fitting, hardware, args, target=None, rough: dict | None = None) -> dict:
    """Compile ``fitting`` (``compile_order``'s order) up to the limits and price each program.
    With ``rough`` (each layout's rough time), once every memory kind's first layout is compiled
    the rest go in ``reranked`` order, updated after each compile."""
    from jaxdist.plan.cost import predict_summary
    from jaxdist.plan.hlo_cost import ProgramCost
    from jaxdist.plan.search import (
        HEADROOM,
        compile_summary,
        configured,
        plan_notes,
        routed_expert_params,
        say_note,
        states_bytes,
    )

    if target is not None:
        usable = allowed_memory(hardware)
    else:
        usable = HEADROOM * hardware.memory_bytes

    start, priced, skipped, failed, notes = time.monotonic(), [], 0, [], []
    # A GPU plan learns from its compiles: per remat policy and optimizer offload, the smallest XLA:GPU peak / estimate seen;
    # a layout whose estimate times that exceeds the memory (5% slack) is left uncompiled
    ratios: dict[str, float] = {}
    tried = left_out = past = 0
    bar = tqdm(
        total=min(args.max_compiles, len(fitting)),
        desc="compiling layouts",
        unit="layout",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
    queue = collections.deque(fitting)
    firsts_left = len({memory_kind(c) for c, _ in fitting})  # compile_order put one of each kind first
    speed: dict[tuple[str, bool], float] = {}  # per memory kind: the smallest compiled step / rough time among those that fit
    ranked_by: dict[tuple[str, bool], float] = {}  # the speeds the queue was last ranked by
    # last (XLA:GPU only), the fastest layout that fits compiles once more with collective matmuls where it has a tensor
    # axis, then the fastest once more with its layers in a Python loop
    refinements = ["collective_matmul", "scan_layers"] if target is not None and rough is not None else []
    refinements = [r for r in refinements if r != "scan_layers" or config.model.scan_layers]
    refining, fitted = bool(refinements), []
    # each layout compiles in a child process: XLA aborts its process on a failed internal check
    with CompileWorker(cpu_only=target is None) as worker:
        while queue or refinements:
            if not queue:
                twin = refined(refinements.pop(0), fitted, config)
                if twin is not None:
                    queue.append(twin)
                continue
            if rough is not None and firsts_left <= 0 and speed != ranked_by and tried < args.max_compiles:
                queue, ranked_by = collections.deque(reranked(list(queue), rough, speed)), dict(speed)
            candidate, estimate = queue.popleft()
            firsts_left -= 1
            if tried >= args.max_compiles and candidate.scan_layers and not candidate.collective_matmul:
                past += 1
                continue
            if time.monotonic() - start > args.time_budget:
                skipped += 1
                continue
            kind = memory_kind(candidate)
            if kind in ratios and estimate * ratios[kind] > 1.05 * usable:
                left_out += 1
                continue
            tried += 1
            bar.update(1)
            bar.set_postfix_str(candidate.label())
            try:
                summary, cached = compile_summary(configured(config, candidate), target=target, compiler=worker.compile)
            except Exception as e:  # noqa: BLE001 - a layout XLA cannot compile is reported, and the search goes on
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                log.warning(f"{candidate.label()} does not compile ({reason}); left out of the ranking")
                failed.append({"layout": candidate.label(), "error": reason})
                continue
            if target is not None and estimate > 0:
                ratios[kind] = min(ratios.get(kind, math.inf), summary["memory"]["peak"] / estimate)
            program = ProgramCost.from_dict(summary["program"])
            p = predict_summary(program, hardware, summary)
            layout_notes = plan_notes(summary.get("notes", []), hardware.shared_host)
            notes += layout_notes
            states = summary["memory"]["arguments"]
            if target is not None:
                memory, source = summary["memory"]["peak"], "XLA:GPU peak"
            elif hardware.fused_attention:  # XLA:CPU's temp holds unfused attention scores: states + activation estimate
                memory, source = (
                    states + max(estimate - states_bytes(candidate, summary["params"], routed_expert_params(config)), 0.0),
                    "states compiled + activations estimated",
                )
            else:
                memory, source = summary["memory"]["total"], "compiled"
            priced.append(
                {
                    "mesh": candidate.mesh_spec,
                    "microbatches": candidate.microbatches,
                    "remat": candidate.remat,
                    "optimizer_offload": candidate.optimizer_offload,
                    "scan_layers": candidate.scan_layers,
                    "collective_matmul": candidate.collective_matmul,
                    "context_strategy": candidate.context_strategy or None,
                    "schedule": pipeline_name(config, candidate),
                    **p.to_dict(),
                    "memory_per_device_bytes": int(memory),
                    "memory_source": source,
                    "fits": memory <= usable,
                    "cached": cached,
                    "notes": layout_notes,
                }
            )
            if memory <= usable and refining:
                fitted.append((p.step_time_s, candidate, estimate))
            if memory <= usable and rough is not None and rough.get(candidate, 0) > 0:
                speed[kind] = min(speed.get(kind, math.inf), p.step_time_s / rough[candidate])
            if memory > usable:  # the same layout with its optimizer state on host is the next to try, if offered
                twin = dataclasses.replace(candidate, optimizer_offload=True)
                offered = [item for item in queue if item[0] == twin]
                if not offered or candidate.optimizer_offload:  # else the next of its memory kind the peaks say may fit
                    bound = 1.05 * usable / ratios.get(kind, 1.0)
                    offered = [item for item in queue if memory_kind(item[0]) == kind and item[1] <= bound][:1]
                if offered:
                    queue.remove(offered[0])
                    queue.appendleft(offered[0])
                    firsts_left += 1  # it takes the place of its kind's first: rerank after it
    bar.close()
    for note in plan_notes(notes, hardware.shared_host):  # each once, however many layouts compiled it
        say_note(note)
    compiler = f"with XLA:GPU for {args.gpus} x {hardware.name}" if target is not None else f"against {args.gpus} fake CPU devices"
    reused = sum(c["cached"] for c in priced)
    looped = sum(not c["scan_layers"] for c in priced)
    ringed = sum(c["collective_matmul"] and c["scan_layers"] for c in priced) if not config.parallel.collective_matmul else 0
    again = [what for what, n in (("with collective matmuls", ringed), ("as a Python loop", looped)) if n]
    log.info(
        f"compiled {tried - looped - ringed} of {len(fitting)} screened layouts {compiler}"
        f"{' and the fastest again ' + ' and '.join(again) if again else ''}"
        f" ({tried - reused} new, {reused} cached"
        f"{f'; {left_out} left out: the compiled peaks say they do not fit' if left_out else ''}"
        f"{f'; {skipped} past --time-budget' if skipped else ''}{f'; {past} past --max-compiles' if past else ''})"
    )
    ranked = sorted((c for c in priced if c["fits"]), key=lambda c: c["step_time_s"])
    return {
        "config": config.name,
        "gpus": args.gpus,
        "hardware": hardware.key,
        "hardware_name": hardware.name,
        "gpus_per_node": min(hardware.gpus_per_node, args.gpus),
        "global_batch": config.train.global_batch,
        "seq_len": config.train.seq_len,
        "layouts": {
            "valid": None,
            "fitting_estimate": len(fitting),
            "compiled": len(priced),
            "over_budget": skipped,
            "left_out_by_compiled_memory": left_out,
        },
        "compiler": "XLA:GPU" if target is not None else "XLA:CPU",
        "candidates": ranked,
        "did_not_fit": [c for c in priced if not c["fits"]],
        "failed_to_compile": failed,
    }


def format_table(result: dict, top: int) -> str:
    lines = [
        f"{result['config']} on {result['gpus']} x {result['hardware_name']} ({result['gpus_per_node']} per node), "
        f"global batch {result['global_batch']} x {result['seq_len']} tokens; "
        f"{result['layouts']['compiled']} of {result['layouts']['fitting_estimate']} screened layouts compiled",
        f"{'#':>2}  {'mesh':<34} {'mb':>3} {'remat':<28} {'step':>9} {'tok/s/dev':>10} {'MFU':>6} {'memory':>9}  bound",
    ]
    for i, c in enumerate(result["candidates"][:top], 1):
        mesh = f"{c['mesh']} {c['context_strategy']}" if c.get("context_strategy") else c["mesh"]
        mesh += f" {c['schedule']}" if c.get("schedule") else ""
        marks = ("+opt" if c.get("optimizer_offload") else "") + ("" if c.get("scan_layers", True) else "+loop")
        remat = c["remat"] + marks + ("+cm" if c.get("collective_matmul") else "")
        lines.append(
            f"{i:>2}  {mesh:<34} {c['microbatches']:>3} {remat:<28} {format_seconds(c['step_time_s']):>9} "
            f"{c['tokens_per_sec_per_device']:>10,.0f} {format_fraction(c['mfu']):>6} {format_bytes(c['memory_per_device_bytes']):>9}  {c['bound']}"
        )
    if not result["candidates"]:
        lines.append("no compiled layout fits (see --json's did_not_fit)")
    return "\n".join(lines)


def format_seconds(t: float) -> str:
    """3 significant figures in s, ms or us: a small model's step is not "0.000"."""
    if t == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        value = t / scale
        if float(f"{value:.3g}") >= 1 or unit == "us":  # rounded first: 0.9996 s is 1.00 s, not 1.00e+03 ms
            return f"{value:,.0f} {unit}" if value >= 1000 else f"{f'{value:#.3g}'.rstrip('.')} {unit}"  # 1.40 ms, 387 us
    raise AssertionError("unreachable")


def format_fraction(x: float) -> str:
    """A percentage with 2 significant figures below 1% (0.04%, not 0.0%)."""
    return f"{x:.1%}" if x >= 0.01 or x == 0 else f"{x * 100:.2g}%"


def format_bytes(n: float) -> str:
    """GiB with one decimal; MiB (3 significant figures) below 1,000 MiB: a small model's memory is not "0.0"."""
    return f"{n / GIB:.1f} GiB" if n >= 999.5 * 2**20 else f"{f'{n / 2**20:#.3g}'.rstrip('.')} MiB"  # 1,000 MiB on: GiB


def fake_cpu_devices(n: int) -> None:
    """N CPU devices to compile against, also on a GPU machine (before JAX starts; once
    it has started, the compile says when there are too few)."""
    if "jax" in sys.modules and devices.backend_started():
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(n, 1)}".strip()


def prepare_compiler(hardware: str, gpus: int) -> None:
    """Before JAX starts: a GPU target's compile-only devices need a CPU backend and the CUDA
    plugin (``plan.gpu_target.prepare_target``); cpu-local (or a GPU profile without the plugin,
    which ``plan`` says) compiles against ``gpus`` fake CPU devices."""
    if hardware in TARGETS and devices.cuda_plugin_installed():
        prepare_target()
    else:
        devices.run_on_cpu_unless_gpu()  # no GPU: the CUDA plugin stays unloaded
        fake_cpu_devices(gpus)


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    check_limits(args)  # before JAX starts
    prepare_compiler(args.hardware, args.gpus)
    result = plan(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result, args.top))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
