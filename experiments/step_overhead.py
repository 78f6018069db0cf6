"""jaxdist's 1-core train step beside PyTorch's, in one process, interleaved.

    python experiments/step_overhead.py [--rounds 7] [--steps 3] [--variants default,layer-loop] [--trace DIR]

The model of the scaling study (LLaMA-style, d_model 128, 4 layers, 4 heads / 2 kv heads,
vocab 256, seq 128, fp32, AdamW with clipping), batch 16 x 128. The process pins itself
to one core before JAX and PyTorch start (``sched_setaffinity``; PyTorch with one
thread), so both frameworks run under the same settings, and each round runs
``--steps`` steps of every case in turn: the ratios are measured side by side. Printed:
the median step of each case and its ratio to PyTorch's (goal <= 1.1). ``--trace DIR``
also traces two steps of each jaxdist variant and prints where its time goes by op
category (matmuls, layout copies, zero-fills, slice updates, the rest).

Variants are config overrides (``VARIANTS``); ``default`` is jaxdist as shipped.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # before any thread pool exists
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1 " + os.environ.get("XLA_FLAGS", "")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODEL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256"]
MODEL += ["model.dtype=float32", "train.seq_len=128", "data.source=synthetic", "train.global_batch=16", "train.lr=3e-3"]
VARIANTS = {  # name -> config overrides
    "default": [],
    "layer-loop": ["model.scan_layers=false"],
    "save-matmuls": ["model.remat=save_matmuls"],
    "unfused": ["model.fused_projections=false"],
    "jax-attention": [],  # PATCHES: what the step was before issue 28, for a side-by-side ratio
    "autodiff-split": [],
}


def _jax_attention(q, k, v, segment_ids):
    from jaxdist.models.attention import document_causal_mask

    mask = None if segment_ids is None else document_causal_mask(segment_ids)
    return jax_nn().dot_product_attention(q, k, v, mask=mask, is_causal=segment_ids is None, implementation="xla")


def jax_nn():
    import jax

    return jax.nn


def _autodiff_joined(equation, x, w, out_axis, w_axis, sizes):
    import jax.numpy as jnp

    return jnp.einsum(equation, x, w)


# Variants that swap one function while their step is traced: jaxdist's former attention
# (jax.nn.dot_product_attention, which keeps the [B,H,T,T] probabilities for the backward)
# and autodiff through the fused projections (one weight-gradient matmul over the joined gradient).
PATCHES = {
    "jax-attention": ("jaxdist.models.attention", "grouped_attention", _jax_attention),
    "autodiff-split": ("jaxdist.models.llama", "project_joined", _autodiff_joined),
}
BATCH, SEQ = 16, 128


def jaxdist_case(variant: str):
    import importlib

    if variant in PATCHES:
        module, name, replacement = PATCHES[variant]
        module = importlib.import_module(module)
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            return jaxdist_case_built(VARIANTS[variant])
        finally:
            setattr(module, name, original)
    return jaxdist_case_built(VARIANTS[variant])


def jaxdist_case_built(overrides: list[str]):
    import jax

    from jaxdist.config import load_config
    from jaxdist.data.batches import make_iterator
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import build_trainer

    config = load_config(None, MODEL + overrides)
    trainer = build_trainer(config, parse_mesh("data=1"), jax.devices()[:1])
    state = trainer.init_state(0)
    batches = make_iterator(config, trainer.layout)
    batch = next(batches)
    batches.close()
    compiled = trainer.train_step.lower(state, batch).compile()
    holder = {"state": state}

    def step():
        holder["state"], metrics = compiled(holder["state"], batch)
        jax.block_until_ready(metrics["loss"])

    return step


def torch_case():
    import torch
    import torch.nn.functional as F
    from torch_baseline import Dims, Llama, make_optimizer

    torch.set_num_threads(1)
    model = Llama(Dims(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2))
    model.reset_parameters(0)
    optimizer = make_optimizer(model, 3e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())

    def step():  # as torch_baseline.train_steps
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return step


def categorize(name: str) -> str:
    """An XLA:CPU op name -> what kind of work it is."""
    if name.startswith(("ynn_fusion", "dot", "convolution")) or "dot" in name.split("_"):
        return "matmul"
    if "dynamic-update-slice" in name:
        return "slice update (scan buffers)"
    if name.startswith("wrapped_broadcast") or name.startswith("broadcast."):
        return "zero-fill / broadcast"
    if name.startswith(("copy", "transpose")) or "transpose" in name or name.startswith("bitcast_pad") or "copy_bitcast" in name:
        return "layout copy / transpose / pad"
    return "elementwise / reduce / other"


def trace_categories(step, directory: Path) -> dict[str, float]:
    """Seconds per step by op category over two traced steps."""
    import jax

    from jaxdist.inspect.trace_reader import find_traces, read_process

    (directory / "profile" / "process_0").mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(directory / "profile" / "process_0"))
    for i in range(2):
        with jax.profiler.StepTraceAnnotation("train_step", step_num=i + 1):  # what jaxdist.inspect.trace_reader reads
            step()
    jax.profiler.stop_trace()
    totals: dict[str, float] = defaultdict(float)
    for index, proc, trace_file in find_traces(directory):
        for ops in read_process(index, proc, trace_file).devices.values():
            for op in ops:
                totals[categorize(re.sub(r"[._]\d+$", "", op.name))] += (op.end - op.start) / 2
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/step_overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="steps of each case per round")
    p.add_argument("--variants", default="default", help="comma list of " + ",".join(VARIANTS))
    p.add_argument("--no-torch", action="store_true", help="jaxdist variants only")
    p.add_argument("--trace", type=Path, default=None, help="also trace each jaxdist variant into this folder")
    args = p.parse_args(argv)
    import jax

    cases = {} if args.no_torch else {"pytorch": torch_case()}
    for v in args.variants.split(","):
        cases[f"jaxdist {v}"] = jaxdist_case(v)
    versions = f"jax {jax.__version__}" + ("" if args.no_torch else f", torch {__import__('torch').__version__} (1 thread)")
    from scaling import _cpu_model

    print(f"host: {_cpu_model()}, pinned to 1 of {os.cpu_count()} cores; {versions}; batch {BATCH} x {SEQ}")
    for step in cases.values():  # warm-up
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, step in cases.items():
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    # CPU time: what the step itself used of its core; other processes on the host stretch
    # the wall clock of both frameworks alike but not this.
    print("\n| case | median step ms (wall) | vs PyTorch | median CPU ms per step | vs PyTorch |")
    print("| --- | --- | --- | --- | --- |")
    for name, t in med.items():
        ratio = f"{t / med['pytorch']:.2f}" if "pytorch" in med else "-"
        ratio_cpu = f"{med_cpu[name] / med_cpu['pytorch']:.2f}" if "pytorch" in med else "-"
        print(f"| {name} | {t * 1e3:.1f} | {ratio} | {med_cpu[name] * 1e3:.1f} | {ratio_cpu} |")
    if args.trace:
        print(
            "\n| variant | "
            + " | ".join(
                [
                    "matmul",
                    "layout copy / transpose / pad",
                    "zero-fill / broadcast",
                    "slice update (scan buffers)",
                    "elementwise / reduce / other",
                ]
            )
            + " |"
        )
        print("| --- " * 6 + "|")
        for name, step in cases.items():
            if name == "pytorch":
                continue
            cats = trace_categories(step, args.trace / name.replace(" ", "_"))
            total = sum(cats.values())
            keys = [
                "matmul",
                "layout copy / transpose / pad",
                "zero-fill / broadcast",
                "slice update (scan buffers)",
                "elementwise / reduce / other",
            ]
            print(f"| {name} | " + " | ".join(f"{cats.get(k, 0) * 1e3:.1f} ms ({cats.get(k, 0) / total:.0%})" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
