"""``python -m jaxdist.eval``: a checkpoint's loss and perplexity on its corpus's held-out split.

    python -m jaxdist.eval --checkpoint PATH [--mesh SPEC] [--batches N] [data.* / train.* keys] [--json]
    python -m jaxdist.eval --checkpoint PATH --tasks NAMES [--include-path DIR] [--num-fewshot K] [--limit N]
        [--apply-chat-template] [--batch-size B] [--mesh SPEC] [--json]

The data keys default to the checkpoint's own (the held-out tail, ``data.eval_fraction``,
of the corpus it trained on); override them to score another corpus. Each held-out window
of ``train.seq_len`` tokens is scored once, in order, in at most ``--batches N``
(``train.eval_batches``) batches of ``train.global_batch`` (the last one padded; it says
so when the split holds fewer batches than asked), the same ones for every checkpoint,
so two checkpoints compare directly. ``tokens`` counts the targets actually scored
(predictions across an end of document carry no loss).

``--tasks`` (comma-separated) runs lm-evaluation-harness tasks instead (``pip install
'jaxdist[eval]'``): lm-eval's registry's, or those defined by YAML files under
``--include-path``. Nothing is downloaded: a task whose data are not local fails with one
line. The scores are printed and written to ``RUN_DIR/eval/STEP.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import jaxdist
from jaxdist import errors
from jaxdist.errors import EXIT_OK, JaxdistError
from jaxdist.inference.loading import checkpoint_arg_parser, load_config
from jaxdist.layout.devices import run_on_cpu_unless_gpu


def build_arg_parser():
    parser = checkpoint_arg_parser("python -m jaxdist.eval", "Loss and perplexity of a checkpoint on held-out data.")
    parser.add_argument("--batches", type=int, default=None, help="batches to score (train.eval_batches)")
    parser.add_argument("--tasks", default=None, help="lm-evaluation-harness tasks, comma-separated (instead of the held-out loss)")
    parser.add_argument("--include-path", default=None, help="a directory of lm-eval task YAML files (--tasks)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per request (--tasks; default: the task's)")
    parser.add_argument("--limit", type=int, default=None, help="at most N examples per task (--tasks)")
    parser.add_argument("--apply-chat-template", action="store_true", help="render requests with the run's chat template (--tasks)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per batch (--tasks; default 16)")
    return parser


HARNESS_ONLY = ("include_path", "num_fewshot", "limit", "apply_chat_template")


def check_harness_args(args) -> list[str]:
    """The task names; one line for what cannot run (before JAX starts)."""
    if args.tasks is None:
        given = [f"--{a.replace('_', '-')}" for a in HARNESS_ONLY if getattr(args, a) not in (None, False)]
        if given:
            raise JaxdistError(f"{', '.join(given)} only apply with --tasks")
        return []
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise JaxdistError("--tasks: no task named")
    if args.batches is not None:
        raise JaxdistError("--batches applies to the held-out loss, not to --tasks")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise JaxdistError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.limit is not None and args.limit < 1:
        raise JaxdistError(f"--limit must be positive, got {args.limit}")
    if args.batch_size < 1:
        raise JaxdistError(f"--batch-size must be positive, got {args.batch_size}")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise JaxdistError(f"--include-path {args.include_path}: no such directory")
    return tasks


def print_tasks(result: dict) -> None:
    print(f"{result['checkpoint']} (step {result['step']}, {result['seconds']:.1f} s):")
    for task, metrics in result["tasks"].items():
        print(f"  {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if result["eval_file"]:
        print(f"written to {result['eval_file']}")


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args, config, step_dir = load_config(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    if args.batches is not None:
        if args.batches < 1:
            raise JaxdistError(f"--batches must be positive, got {args.batches}")
        config.train.eval_batches = args.batches
    tasks = check_harness_args(args)
    run_on_cpu_unless_gpu()  # before JAX is imported
    from jaxdist.inference.evaluation import evaluate, evaluate_tasks  # imports JAX: once the platform is chosen

    if tasks:
        os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})  # before lm-eval loads datasets: nothing downloads
        result = evaluate_tasks(
            config,
            step_dir,
            tasks,
            include_path=args.include_path,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            apply_chat_template=args.apply_chat_template,
            batch_size=args.batch_size,
        )
        if args.json:
            print(json.dumps(result))
        else:
            print_tasks(result)
        return EXIT_OK
    result = evaluate(config, step_dir)
    if args.json:
        print(json.dumps(result))
    else:
        windows = f", {result['windows']} windows" if result["windows"] is not None else ""
        print(
            f"{step_dir}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over {result['tokens']:,} tokens "
            f"({result['batches']} batches{windows})"
        )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
