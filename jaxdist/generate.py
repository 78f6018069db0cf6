"""``python -m jaxdist.generate``: sample from a checkpoint with a KV cache.

    python -m jaxdist.generate --checkpoint PATH (--prompt TEXT | --prompt-ids 1,2,3)
        [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--mesh SPEC] [--json]

Temperature 0 (the default) is greedy. The prompt runs through the model once (prefill),
filling a cache of every layer's keys and values; each new token then costs one
token's forward pass over the cache (``Llama.decode``). Prefill and the whole sampling
loop are one compiled program, with the parameters in the mesh's shardings (``--mesh
tensor=N`` splits heads). With a tokenizer, generation stops at its end-of-document id.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError


def sample(logits, key, temperature: float, top_p: float):
    """Next ids [batch] from last-position logits [batch, vocab] (float32)."""
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1:
        # Nucleus: keep the most likely ids whose probabilities, before their own, sum to < top_p.
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate_ids(model, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, key=None):
    """[batch, max_new_tokens] ids sampled after ``prompt`` [batch, t] (trace under jit)."""
    import jax
    import jax.numpy as jnp

    from jaxdist.models.llama import KVCache

    key = jax.random.key(0) if key is None else key
    cache = KVCache.zeros(model.cfg, prompt.shape[0], prompt.shape[1] + max_new_tokens, model.dtype)
    logits, cache = model.decode(prompt, cache)

    def step(carry, step_key):
        cache, last = carry
        token = sample(last, step_key, temperature, top_p)
        logits, cache = model.decode(token[:, None], cache)
        return (cache, logits[:, -1]), token

    _, tokens = jax.lax.scan(step, (cache, logits[:, -1]), jax.random.split(key, max_new_tokens))
    return jnp.transpose(tokens)


def compile_generate(loaded, prompt_shape: tuple[int, int], max_new_tokens: int, temperature: float, top_p: float):
    """The compiled program: (params, prompt ids, key) -> new ids."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdist.sharding import activation_layout

    trainer = loaded.trainer

    def run(params, prompt, key):
        with activation_layout(trainer.layout):
            model = nnx.merge(trainer.graphdef, params)
            return generate_ids(model, prompt, max_new_tokens, temperature=temperature, top_p=top_p, key=key)

    replicated = trainer.layout.replicated()
    jitted = jax.jit(run, in_shardings=(trainer.param_shardings, replicated, replicated), out_shardings=replicated)
    return jitted.lower(trainer.abstract_params(), jax.ShapeDtypeStruct(prompt_shape, jnp.int32), jax.random.key(0)).compile()


def _prompt_ids(args, tokenizer, valid: int) -> list[int]:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise JaxdistError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if args.prompt is not None:
        ids = [int(i) for i in tokenizer.encode_prompt(args.prompt)]
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise JaxdistError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    if not ids:
        raise JaxdistError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < valid]
    if bad:
        raise JaxdistError(f"prompt ids {bad[:3]} are outside the model's vocab (0..{valid - 1})")
    return ids


def build_arg_parser():
    from jaxdist.inference import checkpoint_arg_parser

    parser = checkpoint_arg_parser("python -m jaxdist.generate", "Generate text from a checkpoint (KV-cached sampling).")
    parser.add_argument("--prompt", default=None, help="text, encoded with the model's tokenizer")
    parser.add_argument("--prompt-ids", default=None, help="token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of ids with this much probability"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jaxdist.data.tokenizers import load_tokenizer
    from jaxdist.inference import load, load_config

    try:
        args, config, step_dir = load_config(build_arg_parser(), argv)
        if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
            raise JaxdistError("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
        tokenizer = load_tokenizer(config.data.tokenizer or None)
        m = config.model
        ids = _prompt_ids(args, tokenizer, m.valid_vocab or m.vocab_size or tokenizer.vocab_size)
        loaded = load(config, step_dir)
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import jax
    import numpy as np

    compiled = compile_generate(loaded, (1, len(ids)), args.max_new_tokens, args.temperature, args.top_p)
    new = [int(i) for i in np.asarray(jax.device_get(compiled(loaded.params, np.asarray([ids], np.int32), jax.random.key(args.seed))))[0]]
    if config.data.tokenizer and tokenizer.eod_id in new:  # stop at the end of the document
        new = new[: new.index(tokenizer.eod_id)]
    text = tokenizer.decode(new)
    if args.json:
        print(json.dumps({"ids": new, "text": text, "prompt_ids": ids, "checkpoint": str(step_dir)}))
    else:
        print((args.prompt or "") + text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
