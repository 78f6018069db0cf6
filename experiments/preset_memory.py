"""The memory per device ``python -m jaxdist.analyze`` reports for a preset, under a few overrides:
the figures the README quotes for ``llama3-8b-128k``, printed with the date and JAX version that
go beside them.

    python experiments/preset_memory.py [--config llama3-8b-128k] [--variant LABEL=KEY=VALUE[,KEY=VALUE...] ...] [--json]

Each variant is one ``python -m jaxdist.analyze --config C --json [overrides]`` in its own process
(compile only, on fake CPU devices for the preset's mesh: nothing is allocated). The defaults are
the README's three: the preset as it is (``all_gather``), ``parallel.context_strategy=ring``, and
``model.loss_chunk=0`` (the whole [tokens, vocab] logits at once). Figures are XLA:CPU's; no
wall-clock time is printed (the README quotes none: it depends on the host's load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys

GIB = 2**30
DEFAULT_VARIANTS = (
    ("all_gather (as configured)", ()),
    ("ring", ("parallel.context_strategy=ring",)),
    ("no loss_chunk", ("model.loss_chunk=0",)),
)


def analyze(config: str, overrides: tuple[str, ...]) -> dict:
    """``python -m jaxdist.analyze --json``'s object (a failure is one line naming the variant)."""
    cmd = [sys.executable, "-m", "jaxdist.analyze", "--config", config, "--json", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"preset_memory: {' '.join(cmd[1:])} failed: {last}")
    return json.loads(proc.stdout)


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    label, sep, overrides = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: LABEL=KEY=VALUE[,KEY=VALUE...]")
    return label, tuple(o for o in overrides.split(",") if o)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Memory per device of a preset, as python -m jaxdist.analyze compiles it.")
    parser.add_argument("--config", default="llama3-8b-128k")
    parser.add_argument("--variant", action="append", type=parse_variant, help="LABEL=KEY=VALUE[,...] (default: the README's three)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    variants = args.variant or DEFAULT_VARIANTS
    import jax  # the version only: the compiles run in their own processes

    rows = []
    for label, overrides in variants:
        report = analyze(args.config, overrides)
        memory = report["memory_per_device_bytes"]
        rows.append({"variant": label, "overrides": list(overrides), "mesh": report["mesh"], "platform": report["platform"], **memory})
    stamp = {"config": args.config, "date": datetime.date.today().isoformat(), "jax_version": jax.__version__}
    if args.json:
        print(json.dumps({**stamp, "rows": rows}))
        return 0
    mesh = ",".join(f"{a}={n}" for a, n in rows[0]["mesh"].items() if n > 1)
    devices = math.prod(rows[0]["mesh"].values())
    print(f"{args.config} on {mesh} ({devices} {rows[0]['platform']} devices), GiB per device; {stamp['date']}, jax {stamp['jax_version']}")
    print(f"{'variant':<28}{'total':>8}{'arguments':>11}{'temp':>8}")
    for r in rows:
        print(f"{r['variant']:<28}{r['total'] / GIB:>8.1f}{r['arguments'] / GIB:>11.1f}{r['temp'] / GIB:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
