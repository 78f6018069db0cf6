"""``python -m jaxdist.eval``: a checkpoint's loss and perplexity on its corpus's held-out split.

    python -m jaxdist.eval --checkpoint PATH [--mesh SPEC] [--batches N] [data.* / train.* keys] [--json]

The data keys default to the checkpoint's own (the held-out tail, ``data.eval_fraction``,
of the corpus it trained on); override them to score another corpus. ``--batches N``
(``train.eval_batches``) batches of ``train.global_batch`` x ``train.seq_len`` tokens
are scored, the same ones for every checkpoint, so two checkpoints compare directly.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence

from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError


def build_arg_parser():
    from jaxdist.inference import checkpoint_arg_parser

    parser = checkpoint_arg_parser("python -m jaxdist.eval", "Loss and perplexity of a checkpoint on held-out data.")
    parser.add_argument("--batches", type=int, default=None, help="batches to score (train.eval_batches)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jaxdist.inference import load, load_config

    try:
        args, config, step_dir = load_config(build_arg_parser(), argv)
        if args.batches is not None:
            if args.batches < 1:
                raise JaxdistError(f"--batches must be positive, got {args.batches}")
            config.train.eval_batches = args.batches
        loaded = load(config, step_dir)
        import jax
        import numpy as np

        from jaxdist.data.pipeline import eval_batches

        trainer = loaded.trainer
        totals = np.zeros(2, np.float64)
        for batch in eval_batches(config, trainer.layout):
            totals += np.asarray(jax.device_get(trainer.eval_step(loaded.params, batch)), np.float64)
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    loss = float(totals[0] / totals[1])
    result = {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": int(totals[1]),
        "batches": config.train.eval_batches,
        "checkpoint": str(step_dir),
        "step": loaded.step,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{step_dir}: loss {loss:.4f}, perplexity {result['perplexity']:.2f} over {result['tokens']:,} tokens ({result['batches']} batches)"
        )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
