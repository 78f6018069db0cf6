"""``python -m jaxdist.eval``: a checkpoint's loss and perplexity on its corpus's held-out split.

    python -m jaxdist.eval --checkpoint PATH [--mesh SPEC] [--batches N] [data.* / train.* keys] [--json]

The data keys default to the checkpoint's own (the held-out tail, ``data.eval_fraction``,
of the corpus it trained on); override them to score another corpus. Each held-out window
of ``train.seq_len`` tokens is scored once, in order, in at most ``--batches N``
(``train.eval_batches``) batches of ``train.global_batch`` (the last one padded; it says
so when the split holds fewer batches than asked), the same ones for every checkpoint,
so two checkpoints compare directly. ``tokens`` counts the targets actually scored
(predictions across an end of document carry no loss).
"""

from __future__ import annotations

import json
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
    return parser


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args, config, step_dir = load_config(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    if args.batches is not None:
        if args.batches < 1:
            raise JaxdistError(f"--batches must be positive, got {args.batches}")
        config.train.eval_batches = args.batches
    run_on_cpu_unless_gpu()  # before JAX is imported
    from jaxdist.inference.evaluation import evaluate  # imports JAX: once the platform is chosen

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
