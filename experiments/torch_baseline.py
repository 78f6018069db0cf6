"""The PyTorch side of the scaling comparison: jaxdist's LLaMA-style decoder in plain PyTorch.

    python experiments/torch_baseline.py --nproc 2 --strategy ddp --d-model 128 --layers 4 --heads 4 --kv-heads 2 \\
        --vocab 256 --seq-len 128 --global-batch 16 --steps 20 --warmup 5 --threads 1 --lr 3e-3 [--json]

The model is the one in ``jaxdist/models/llama.py`` (pre-norm RMSNorm blocks, RoPE in the
rotate-half layout, grouped-query attention, SwiGLU MLP, final RMSNorm, untied head, no
biases; same initialisation scheme), trained the way a PyTorch user would: fp32, AdamW
(betas 0.9/0.95, weight decay 0.1 on matrices only, constant lr), global-norm clipping 1.0,
mean cross-entropy over tokens. ``tests/test_torch_baseline.py`` checks that the parameter
count and the logits equal jaxdist's.

Strategies (one process per device, ``torch.distributed`` over gloo on 127.0.0.1):
- ``single``: one process, no process group;
- ``ddp``: ``DistributedDataParallel`` with its default bucketing;
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on each block and the root.

Each process gets global_batch / nproc rows of a global batch that depends only on the seed
and the step (not on nproc). Step time is the wall clock on rank 0 from the start of the
step to the end of ``optimizer.step()``, median over the steps after ``--warmup``, with no
synchronisation beyond what DDP/FSDP do themselves. The compute-only time runs the same
number of processes with no gradient communication (DDP: ``no_sync()``; FSDP: an unsharded
local replica); communication overhead = step_time_s - compute_only_step_time_s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FRAMEWORK = {"single": "pytorch", "ddp": "pytorch-ddp", "fsdp": "pytorch-fsdp"}
FSDP_API = "fsdp2 (torch.distributed.fsdp.fully_shard)"


@dataclasses.dataclass(frozen=True)
class Dims:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0 -> d_model // n_heads
    mlp_dim: int = 0  # 0 -> 8/3 * d_model rounded up to a multiple of 64 (jaxdist's default)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ffn(self) -> int:
        return self.mlp_dim or -(-int(8 * self.d_model / 3) // 64) * 64


# -- the model ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [1, seq, 1, head_dim/2] for positions 0..seq-1, as jaxdist's ``rope``."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * freqs
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [batch, seq, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: Dims):
        super().__init__()
        self.h, self.kv, self.hd = c.n_heads, c.n_kv_heads, c.hd
        self.wq = nn.Linear(c.d_model, c.n_heads * c.hd, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.hd, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.hd, bias=False)
        self.wo = nn.Linear(c.n_heads * c.hd, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.h, self.hd), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.kv, self.hd), cos, sin)
        v = self.wv(x).view(b, t, self.kv, self.hd)
        # Query head i reads key/value head i // (h / kv), as jax.nn.dot_product_attention does.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.kv != self.h
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, c: Dims):
        super().__init__()
        self.w_gate = nn.Linear(c.d_model, c.ffn, bias=False)
        self.w_up = nn.Linear(c.d_model, c.ffn, bias=False)
        self.w_down = nn.Linear(c.ffn, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, c: Dims):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """jaxdist's decoder: embedding, pre-norm blocks, final RMSNorm, untied head."""

    def __init__(self, c: Dims):
        super().__init__()
        self.dims = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.final_norm = RMSNorm(c.d_model, c.norm_eps)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # not buffers: nothing for DDP to broadcast

    def reset_parameters(self, seed: int) -> None:
        """jaxdist's scheme: embedding N(0, 1), matrices N(0, 1/fan_in), norm scales 1."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "embed.weight":
                    p.normal_(0.0, 1.0, generator=g)
                else:
                    p.normal_(0.0, p.shape[1] ** -0.5, generator=g)  # nn.Linear weight: [out, in]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] (float32) for tokens [batch, seq]."""
        t = tokens.shape[1]
        if t not in self._rope:
            self._rope[t] = rope_tables(t, self.dims.hd, self.dims.rope_theta)
        cos, sin = self._rope[t]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.final_norm(x))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_jaxdist_params(model: Llama, tree: dict) -> None:
    """Copy jaxdist's Llama parameters (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``,
    arrays of any kind) into ``model``. jaxdist keeps einsum layouts (wq [d, h, hd], wo [h, hd, d],
    w_gate [d, f], head [d, V]) with blocks stacked on a leading layer axis; ``nn.Linear``
    holds [out, in]. With ``model.fused_projections`` (the default) jaxdist holds
    wqkv [d, kv, h/kv + 2, hd] (per kv head: its query heads, then k, then v) and
    w_gate_up [d, 2, f]; they are split back into q, k, v and gate, up."""

    def t(x) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(np.array(x, dtype=np.float32))

    def linear(w: torch.Tensor) -> torch.Tensor:  # [in..., out...] already flattened to [in, out]
        return w.T.contiguous()

    c = model.dims
    blocks = tree["blocks"]
    with torch.no_grad():
        model.embed.weight.copy_(t(tree["embed"]))
        model.head.weight.copy_(linear(t(tree["head"])))
        model.final_norm.weight.copy_(t(tree["final_norm"]["scale"]))
        for i, block in enumerate(model.blocks):
            a, m = blocks["attn"], blocks["mlp"]
            block.attn_norm.weight.copy_(t(blocks["attn_norm"]["scale"])[i])
            block.mlp_norm.weight.copy_(t(blocks["mlp_norm"]["scale"])[i])
            if "wqkv" in a:  # query head kv * (h/kv) + j is wqkv[:, kv, j]
                qkv = t(a["wqkv"])[i]
                group = qkv.shape[2] - 2
                wq, wk, wv = qkv[:, :, :group], qkv[:, :, group], qkv[:, :, group + 1]
            else:
                wq, wk, wv = t(a["wq"])[i], t(a["wk"])[i], t(a["wv"])[i]
            block.attn.wq.weight.copy_(linear(wq.reshape(c.d_model, -1)))
            block.attn.wk.weight.copy_(linear(wk.reshape(c.d_model, -1)))
            block.attn.wv.weight.copy_(linear(wv.reshape(c.d_model, -1)))
            block.attn.wo.weight.copy_(linear(t(a["wo"])[i].reshape(-1, c.d_model)))
            if "w_gate_up" in m:
                gate_up = t(m["w_gate_up"])[i]
                gate, up = gate_up[:, 0], gate_up[:, 1]
            else:
                gate, up = t(m["w_gate"])[i], t(m["w_up"])[i]
            block.mlp.w_gate.weight.copy_(linear(gate))
            block.mlp.w_up.weight.copy_(linear(up))
            block.mlp.w_down.weight.copy_(linear(t(m["w_down"])[i]))


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW as jaxdist's: decay on matrices (embedding and head included), not on norm scales."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def global_batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """Token batches [global_batch, seq_len + 1], one per step (or one repeated with --data fixed)."""
    n = 1 if args.data == "fixed" else args.warmup + args.steps
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        out.append(torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1), generator=g))
    return out * (args.warmup + args.steps) if args.data == "fixed" else out


# -- one process -------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients + Adam moments held by this process (local shards under FSDP)."""
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            total += _local(state[key]).numel() * state[key].element_size()
    return total


def _watch_parent(parent: int) -> None:
    """Exit when the launcher dies, so no worker outlives it (even after a SIGKILL)."""

    def loop():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=loop, daemon=True).start()


def train_steps(model, optimizer, batches, rank: int, per_device: int, sync_ctx=None) -> tuple[list[float], list[torch.Tensor]]:
    """Run one step per batch; (wall time of each step on this process, detached local losses)."""
    import contextlib

    times, losses = [], []
    params = list(model.parameters())
    for tokens in batches:
        local = tokens[rank * per_device : (rank + 1) * per_device]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with sync_ctx() if sync_ctx is not None else contextlib.nullcontext():
            logits = model(local[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    return times, losses


def worker(rank: int, args: argparse.Namespace, port: int, result_path: str, parent: int) -> None:
    sys.stdout = sys.stderr  # stdout is the launcher's, for the one result line
    _watch_parent(parent)
    torch.set_num_threads(args.threads)
    with_pg = args.strategy != "single"
    if with_pg:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc, timeout=timedelta(seconds=args.timeout)
        )
    try:
        result = _run(rank, args)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    finally:
        if with_pg:
            dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace) -> dict:
    dims = dims_from_args(args)
    n, per_device = args.nproc, args.global_batch // args.nproc
    model = Llama(dims)
    model.reset_parameters(args.seed)
    params = num_params(model)
    batches = global_batches(args)
    compute_ctx = None
    comm_bytes, comm_note = 0, "no communication"
    local_replica = None
    if args.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        comm_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        comm_note = "DDP: gradient bytes all-reduced per step (sum of grad numel * 4); ring traffic per rank is 2(N-1)/N of it"
        model = DistributedDataParallel(model)
        compute_ctx = model.no_sync
    elif args.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        local_replica = Llama(dims)
        local_replica.load_state_dict(model.state_dict())
        mesh = init_device_mesh("cpu", (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # Full (padded) sizes from the local shards: blocks are all-gathered in forward and
        # again in backward (resharded after forward), the root group (embedding, final
        # norm, head) once (FSDP2 keeps the root unsharded between forward and backward);
        # every gradient is reduce-scattered once.
        block_ids = {id(p) for b in model.blocks for p in b.parameters()}
        full = {id(p): _local(p).numel() * p.element_size() * n for p in model.parameters()}
        blocks_full = sum(v for k, v in full.items() if k in block_ids)
        root_full = sum(v for k, v in full.items() if k not in block_ids)
        comm_bytes = 2 * blocks_full + root_full + (blocks_full + root_full)
        comm_note = "FSDP2: all-gather payload (blocks twice, root once) + reduce-scatter payload (all grads), unsharded padded bytes"
    optimizer = make_optimizer(model, args.lr)

    times, losses = train_steps(model, optimizer, batches, rank, per_device)
    memory = state_bytes(model, optimizer)
    if dist.is_initialized():  # after the timed steps: the global mean loss of each step
        stacked = torch.stack(losses)
        dist.all_reduce(stacked)
        losses = list(stacked / n)

    compute_times: list[float] | None = None
    if args.strategy == "single":
        compute_times = times
    elif args.compute_only:
        dist.barrier()
        if args.strategy == "ddp":
            compute_times, _ = train_steps(model, optimizer, batches, rank, per_device, sync_ctx=compute_ctx)
        else:
            replica_opt = make_optimizer(local_replica, args.lr)
            compute_times, _ = train_steps(local_replica, replica_opt, batches, rank, per_device)
        dist.barrier()

    timed = times[args.warmup :]
    step = statistics.median(timed)
    compute = statistics.median(compute_times[args.warmup :]) if compute_times is not None else None
    return {
        "framework": FRAMEWORK[args.strategy],
        "strategy": args.strategy,
        "fsdp_api": FSDP_API if args.strategy == "fsdp" else None,
        "torch_version": torch.__version__,
        "params": params,
        "processes": n,
        "threads_per_process": torch.get_num_threads(),
        "global_batch": args.global_batch,
        "per_device_batch": per_device,
        "seq_len": args.seq_len,
        "step_time_s": step,
        "step_times_s": timed,
        "compute_only_step_time_s": compute,
        "tokens_per_sec": args.global_batch * args.seq_len / step,
        "first_loss": float(losses[0]),
        "final_loss": float(losses[-1]),
        "memory_per_device_bytes": memory,
        "comm_bytes_per_step": comm_bytes,
        "comm_bytes_note": comm_note,
        "data": args.data,
    }


# -- the launcher ------------------------------------------------------------------------


def dims_from_args(args: argparse.Namespace) -> Dims:
    return Dims(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        mlp_dim=args.mlp_dim,
        rope_theta=args.rope_theta,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="processes (one per device)")
    p.add_argument("--strategy", default="single", help="single | ddp | fsdp")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=0, help="0: d_model / heads")
    p.add_argument("--mlp-dim", type=int, default=0, help="0: 8/3 d_model rounded up to a multiple of 64")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after the warmup)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="random", help="random: a new batch each step | fixed: one batch repeated (the loss must fall)")
    p.add_argument("--no-compute-only", dest="compute_only", action="store_false", help="skip the no-communication timing")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before every process is stopped (exit 124)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, or None."""
    if args.strategy not in FRAMEWORK:
        return f"unknown --strategy {args.strategy!r}: expected single, ddp or fsdp"
    if args.data not in ("random", "fixed"):
        return f"unknown --data {args.data!r}: expected random or fixed"
    positive = ("nproc", "d_model", "layers", "heads", "kv_heads", "vocab", "seq_len", "global_batch", "steps", "threads")
    for name in positive:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.warmup < 0 or args.lr <= 0 or args.timeout <= 0:
        return "--warmup must be >= 0, --lr and --timeout > 0"
    if args.strategy == "single" and args.nproc != 1:
        return f"--strategy single runs one process; got --nproc {args.nproc} (use ddp or fsdp)"
    if args.global_batch % args.nproc:
        return f"--global-batch {args.global_batch} is not divisible by --nproc {args.nproc}"
    if args.heads % args.kv_heads:
        return f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}"
    if not args.head_dim and args.d_model % args.heads:
        return f"--d-model {args.d_model} is not divisible by --heads {args.heads}"
    if (args.head_dim or args.d_model // args.heads) % 2:
        return "the head dimension must be even (RoPE rotates halves)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> dict:
    """Run ``args.nproc`` worker processes; the rank-0 result. Every process is gone on return."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="torch_baseline_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(
            worker, args=(args, free_port(), result_path, os.getpid()), nprocs=args.nproc, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + args.timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {args.timeout:g} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
            for proc in ctx.processes:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        with open(result_path) as f:
            return json.load(f)


def summary(r: dict) -> str:
    compute = r["compute_only_step_time_s"]
    lines = [
        f"{r['framework']} (torch {r['torch_version']}{', ' + r['fsdp_api'] if r['fsdp_api'] else ''}): {r['params']:,} params, "
        f"{r['processes']} process(es) x {r['threads_per_process']} thread(s), batch {r['global_batch']} "
        f"({r['per_device_batch']}/process) x {r['seq_len']}",
        f"  step {r['step_time_s'] * 1e3:.1f} ms (median of {len(r['step_times_s'])}), {r['tokens_per_sec']:,.0f} tokens/s",
    ]
    if compute is not None and r["strategy"] != "single":
        lines.append(f"  compute only {compute * 1e3:.1f} ms -> communication overhead {(r['step_time_s'] - compute) * 1e3:.1f} ms")
    lines.append(f"  loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}")
    lines.append(
        f"  params+grads+Adam per process {r['memory_per_device_bytes'] / 2**20:.2f} MiB, "
        f"communication {r['comm_bytes_per_step'] / 2**20:.2f} MiB/step ({r['comm_bytes_note']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = validate(args)
    if problem:
        print(f"torch_baseline: {problem}", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = launch(args)
    except TimeoutError as e:
        print(f"torch_baseline: {e}", file=sys.stderr)
        return 124
    except Exception as e:  # a worker raised: its traceback, then one line
        print(str(e), file=sys.stderr)
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:] or [type(e).__name__]
        print(f"torch_baseline: a worker failed: {last[0]}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else summary(result))
    if not all(math.isfinite(x) for x in (result["first_loss"], result["final_loss"])):
        print("torch_baseline: the loss is not finite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
