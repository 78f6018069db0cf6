"""Host memory of ``jaxdist.convert from-hf``: peak resident memory against the output's size.

    python experiments/convert_memory.py [--layers 16 --d-model 2048 --mlp 5632 --vocab 32000] [--dtype bfloat16]

Writes a random Llama in Hugging Face's layout (safetensors shards + index), converts it in
a subprocess, and prints the converter's peak RSS beside the checkpoint size (which is what
the converted parameters take on a CPU "device"), the largest layer-stacked tensor and the
RSS of a process that only imports jaxdist and starts JAX. The claim checked: peak RSS is
about the import baseline + the output + one stacked tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

BASELINE = "import jax, jaxdist.convert, orbax.checkpoint, safetensors; jax.devices()"


def write_model(directory: Path, *, layers: int, d: int, mlp: int, vocab: int, heads: int, kv_heads: int, dtype) -> tuple[int, int]:
    """A random checkpoint, one shard per layer; returns (total bytes, largest stacked tensor bytes)."""
    rng = np.random.default_rng(0)
    hd = d // heads
    directory.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": np.dtype(dtype).name,
    }
    (directory / "config.json").write_text(json.dumps(config))

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    weight_map, total = {}, 0
    shards = [{"model.embed_tokens.weight": w(vocab, d), "lm_head.weight": w(vocab, d), "model.norm.weight": w(d)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "self_attn.q_proj.weight": w(heads * hd, d),
                p + "self_attn.k_proj.weight": w(kv_heads * hd, d),
                p + "self_attn.v_proj.weight": w(kv_heads * hd, d),
                p + "self_attn.o_proj.weight": w(d, heads * hd),
                p + "mlp.gate_proj.weight": w(mlp, d),
                p + "mlp.up_proj.weight": w(mlp, d),
                p + "mlp.down_proj.weight": w(d, mlp),
                p + "input_layernorm.weight": w(d),
                p + "post_attention_layernorm.weight": w(d),
            }
        )
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    itemsize = np.dtype(dtype).itemsize
    largest = max(layers * 2 * mlp * d * itemsize, vocab * d * itemsize)  # w_gate_up stacked, or the embedding
    return total, largest


def peak_rss(argv: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes of one child process, from its own rusage; its wall time)."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {child.returncode}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--write-to", default=None, help=argparse.SUPPRESS)  # the child that writes the model
    args = parser.parse_args()
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
    shape = dict(layers=args.layers, d=args.d_model, mlp=args.mlp, vocab=args.vocab, heads=args.heads, kv_heads=args.kv_heads, dtype=dtype)
    if args.write_to:
        print(json.dumps(write_model(Path(args.write_to), **shape)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # A child writes the model: a forked child starts with its parent's resident pages
        # counted in its peak RSS, so this process stays small.
        written = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--write-to", str(root / "hf")], check=True, capture_output=True, text=True
        )
        size, largest = json.loads(written.stdout)
        baseline, _ = peak_rss([sys.executable, "-c", BASELINE])
        peak, wall = peak_rss([sys.executable, "-m", "jaxdist.convert", "from-hf", str(root / "hf"), str(root / "out")])
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    print(f"host: {platform.processor() or platform.machine()}, {platform.python_version()}; model {size / 2**30:.2f} GiB {args.dtype}")
    print(f"checkpoint (= converted parameters)   {mib(size)}")
    print(f"largest stacked tensor                {mib(largest)}")
    print(f"import + JAX start peak RSS           {mib(baseline)}")
    print(f"convert peak RSS                      {mib(peak)}  ({wall:.1f} s)")
    excess = peak - baseline - size
    print(f"peak - baseline - output              {mib(excess)} = {excess / largest:.2f} x the largest stacked tensor")


if __name__ == "__main__":
    main()
