"""``python -m jaxdist.generate``: sample from a checkpoint with a KV cache.

    python -m jaxdist.generate --checkpoint PATH (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT | --messages FILE)
        [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--mesh SPEC] [--json]

Temperature 0 (the default) is greedy. The prompt runs through the model once (prefill),
filling a cache of every layer's keys and values; each new token then costs one
token's forward pass over the cache (``Llama.decode``). Prefill and the whole sampling
loop are one compiled program, with the parameters in the mesh's shardings (``--mesh
tensor=N`` splits heads). Generation stops once the sequence reaches a stop id: the
imported model's ``eos_token_id`` (generation_config.json, else config.json; one or a
list) and the run's tokenizer's end-of-document id; ``--json`` says how many tokens were
decoded (``decoded``) and which ids stop (``stop_ids``).

``--chat TEXT`` (one user message) and ``--messages FILE`` (a JSON list of messages, or
``{"messages": [...]}``) render the conversation with the model's chat template and its
generation prompt (the template the run was fine-tuned with: ``data.chat_template``, else
the one beside its tokenizer) and print the assistant's reply.
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
    parser = checkpoint_arg_parser("python -m jaxdist.generate", "Generate text from a checkpoint (KV-cached sampling).")
    parser.add_argument("--prompt", default=None, help="text, encoded with the model's tokenizer")
    parser.add_argument("--prompt-ids", default=None, help="token ids, comma-separated")
    parser.add_argument("--chat", default=None, help="a user message, rendered with the model's chat template")
    parser.add_argument("--messages", default=None, help='a JSON file: a conversation ([{"role": ..., "content": ...}, ...])')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of ids with this much probability"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args, config, step_dir = load_config(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise JaxdistError("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    run_on_cpu_unless_gpu()  # before JAX is imported
    from jaxdist.inference.generation import ONE_PROMPT, generate, read_messages  # imports JAX: once the platform is chosen

    if args.chat is not None and args.messages is not None:
        raise JaxdistError(ONE_PROMPT)
    messages = [{"role": "user", "content": args.chat}] if args.chat is not None else None
    messages = read_messages(args.messages) if args.messages is not None else messages
    result = generate(
        config,
        step_dir,
        prompt=args.prompt,
        ids_text=args.prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        messages=messages,
    )
    if args.json:
        print(json.dumps(result))
    else:
        text = result["text"]
        if text is None:
            print(",".join(map(str, result["ids"])))
        else:
            print(text if messages is not None else (args.prompt or "") + text)  # a chat: the reply alone
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
