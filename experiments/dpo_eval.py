"""Fine-tuning, then DPO from its checkpoint, then lm-evaluation-harness tasks on both: the
post-training flow of the README, end to end, with the figures it is judged by.

    python experiments/dpo_eval.py [--sft-steps 80] [--dpo-steps 40] [--devices 8] [--docs 256]

The data are synthetic and local: prompts ``abc=``, the chosen answer repeats the word, the
rejected one reverses it. Fine-tuning sees both answers as text (greedy decoding is left
undecided between them); DPO (``train.objective=dpo``, reference: the fine-tuned weights) is
trained on the pairs with ``--mesh data=DEVICES`` on fake CPU devices. Printed:

- the DPO curve (loss and TRL's reward metrics per step, from metrics.jsonl);
- two local tasks (YAML + JSON Lines on held-out words) on both checkpoints through
  ``jaxdist eval --tasks``: a multiple choice between the two answers (``acc``) and greedy
  generation (``exact_match``);
- the harness's throughput: log-likelihood requests and generations per second on 1 device and
  on DEVICES (each task's own ``seconds``, not the start-up), with the thread settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ("model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "model.dtype=float32")
COMMON = (*MODEL, "train.global_batch=32", "train.seq_len=16", "train.lr=5e-3", "train.log_every=1", "train.eval_every=0")
LETTERS = "abcdefgh"


def pairs(n: int, seed: int) -> list[dict]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        if word[0] != word[-1]:
            out.append({"prompt": f"{word}=", "chosen": word, "rejected": word[::-1]})
    return out


def env(devices: int) -> dict[str, str]:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]), "JAX_PLATFORMS": "cpu"}


def jaxdist(args: list[str], devices: int) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], env=env(devices), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def write_tasks(folder: Path, held_out: list[dict]) -> None:
    data = folder / "held_out.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in held_out))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\ndoc_to_text: '{{{{prompt}}}}'\n"
    (folder / "repeat_choice.yaml").write_text(
        f"task: repeat_choice\n{common}output_type: multiple_choice\n"
        "doc_to_choice: '{{[chosen, rejected]}}'\ndoc_to_target: 0\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "repeat_generate.yaml").write_text(
        f"task: repeat_generate\n{common}output_type: generate_until\ndoc_to_target: '{{{{chosen}}}}'\ntarget_delimiter: ''\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=80)
    parser.add_argument("--dpo-steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--docs", type=int, default=256, help="held-out prompts per task")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train = pairs(512, seed=0)
        (root / "sft.jsonl").write_text(
            "".join(json.dumps({"text": p["prompt"] + p[s]}) + "\n" for p in train for s in ("chosen", "rejected"))
        )
        (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in train))
        sft = ["data.source=text", f"data.path={root / 'sft.jsonl'}", "data.text_unit=line", f"train.steps={args.sft_steps}"]
        jaxdist(["jaxdist.train", "--mesh", f"data={args.devices}", "--run-dir", str(root / "sft"), *COMMON, *sft], args.devices)
        dpo = ["train.objective=dpo", "data.source=preference", f"data.path={root / 'pairs.jsonl'}", f"train.steps={args.dpo_steps}"]
        dpo_run = ["jaxdist.train", "--mesh", f"data={args.devices}", "--run-dir", str(root / "dpo"), "--init-from", str(root / "sft")]
        jaxdist([*dpo_run, *COMMON, *dpo], args.devices)

        rows = [json.loads(x) for x in (root / "dpo" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "rewards/accuracies" in r]
        print(f"DPO from the fine-tuned checkpoint, --mesh data={args.devices} ({args.devices} fake CPU devices), beta 0.1, lr 5e-3\n")
        print("| step | loss | rewards/accuracies | rewards/margins | rewards/chosen | rewards/rejected |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["step"] in (1, 2, 3, 5) or r["step"] % 5 == 0:
                print(
                    f"| {r['step']} | {r['loss']:.4f} | {r['rewards/accuracies']:.3f} | {r['rewards/margins']:.3f} "
                    f"| {r['rewards/chosen']:.3f} | {r['rewards/rejected']:.3f} |"
                )

        write_tasks(root, pairs(args.docs, seed=99))
        print(f"\nlm-evaluation-harness, {args.docs} held-out prompts per task\n")
        print("| checkpoint | devices | repeat_choice acc | log-likelihood requests/s | repeat_generate exact_match | generations/s |")
        print("|---|---|---|---|---|---|")
        for name in ("sft", "dpo"):
            for devices in (1, args.devices):
                mesh = "1" if devices == 1 else f"data={devices}"
                scores = {}
                for task in ("repeat_choice", "repeat_generate"):
                    argv = [
                        "jaxdist.eval",
                        "--checkpoint",
                        str(root / name),
                        "--mesh",
                        mesh,
                        "--tasks",
                        task,
                        "--include-path",
                        str(root),
                        "--json",
                    ]
                    out = json.loads(jaxdist(argv, devices).splitlines()[-1])
                    metric = next(v for k, v in out["tasks"][task].items() if k.split(",")[0] in ("acc", "exact_match"))
                    requests = 2 * args.docs if task == "repeat_choice" else args.docs  # two choices a prompt
                    scores[task] = (metric, requests / out["seconds"])  # the tasks' own seconds, not the start-up
                (acc, choice_rate), (exact, gen_rate) = scores["repeat_choice"], scores["repeat_generate"]
                print(f"| {name} | {devices} | {acc:.3f} | {choice_rate:.0f} | {exact:.3f} | {gen_rate:.1f} |")
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")), "?")
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}; fake devices share the cores")
    print(f"thread settings: XLA_FLAGS={env(args.devices)['XLA_FLAGS']!r}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


if __name__ == "__main__":
    main()
