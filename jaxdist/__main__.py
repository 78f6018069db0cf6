"""``jaxdist COMMAND [ARGS]`` (also ``python -m jaxdist COMMAND``): one command over every CLI.

Each command is the ``python -m jaxdist.X`` of the same name, with the same arguments, and
both forms stay: ``jaxdist train --mesh 8x4`` is ``python -m jaxdist.train --mesh 8x4``.
The command's module is imported only once it is chosen, so a bad command costs nothing.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from jaxdist import errors
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK

COMMANDS = {
    "train": ("jaxdist.train", "train a model on a device mesh"),
    "launch": ("jaxdist.launch", "start and supervise the processes of a multi-process or multi-node run"),
    "analyze": ("jaxdist.analyze", "compile the step without running it: memory, FLOPs, collectives (--target: a GPU's program)"),
    "plan": ("jaxdist.plan.__main__", "rank meshes, microbatches and remat for a model on N GPUs"),
    "profile": ("jaxdist.profile", "the bottleneck report of a run's --profile-steps trace"),
    "commbench": ("jaxdist.commbench", "measure the collectives over each mesh axis (a planner link profile)"),
    "data": ("jaxdist.data.__main__", "prepare a corpus into token shards (data prepare)"),
    "convert": ("jaxdist.convert", "Hugging Face weights in (from-hf) and out (to-hf)"),
    "generate": ("jaxdist.generate", "sample from a checkpoint"),
    "eval": ("jaxdist.eval", "loss and perplexity of a checkpoint on a corpus"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: jaxdist COMMAND [ARGS ...]   (jaxdist COMMAND --help for a command's own flags; jaxdist --version)", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return EXIT_OK if argv else EXIT_BAD_INPUT
    name, rest = argv[0], argv[1:]
    if name in ("-V", "--version"):
        print(f"jaxdist {importlib.metadata.version('jaxdist')}")
        return EXIT_OK
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"jaxdist: error: unknown command {name!r} ({hint}commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return EXIT_BAD_INPUT
    errors.ONE_COMMAND_PREFIX = "jaxdist "  # the chosen CLI's usage lines say "jaxdist NAME"
    try:
        return importlib.import_module(COMMANDS[name][0]).main(rest)
    finally:
        errors.ONE_COMMAND_PREFIX = None


if __name__ == "__main__":
    sys.exit(main())
