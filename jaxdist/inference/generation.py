"""Sampling from a checkpoint's Llama with a KV cache (``python -m jaxdist.generate``).

The prompt runs through the model once (prefill), filling a cache of every layer's keys
and values; each new token then costs one token's forward pass over the cache
(``Llama.decode``). Prefill and the whole sampling loop are one compiled program, with the
parameters in the mesh's shardings. Temperature 0 is greedy; ``top_p`` < 1 samples from the
nucleus. Generation stops once the sequence reaches a stop id (``stop_ids``).

A conversation (``chat``: one user message; ``messages``: a JSON file of messages) is
rendered with the model's chat template and its generation prompt (``chat_prompt``), the
same template and tokenizer the model was fine-tuned with, and the template's ``eos_token``
joins the stop ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.config import Config
from jaxdist.data.chat_template import check_messages, find_chat_template
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.hf.files import eos_ids, source_dir
from jaxdist.inference.loading import load
from jaxdist.layout.step_context import StepContext, installed
from jaxdist.models.llama import KVCache

ONE_PROMPT = "give exactly one of --prompt TEXT or --prompt-ids 1,2,3 (or --chat TEXT, --messages FILE)"


def sample(logits, key, temperature: float, top_p: float):
    """Next ids [batch] from last-position logits [batch, vocab] (float32)."""
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


def generate_ids(model, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, key=None, stop_ids=()):
    """([batch, max_new_tokens] ids sampled after ``prompt`` [batch, t], the number of
    tokens decoded) (trace under jit). Decoding ends once every sequence has produced one
    of ``stop_ids``; a sequence that ended holds its stop id from there on."""
    key = jax.random.key(0) if key is None else key
    batch = prompt.shape[0]
    cache = KVCache.zeros(model.cfg, batch, prompt.shape[1] + max_new_tokens, model.dtype)
    logits, cache = model.decode(prompt, cache)
    keys = jax.random.split(key, max_new_tokens)  # token i draws with keys[i], whenever decoding stops
    stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)

    def running(carry) -> jax.Array:
        i, _, _, _, ended = carry
        return (i < max_new_tokens) & ~jnp.all(ended)

    def step(carry):
        i, cache, last, tokens, ended = carry
        token = sample(last, keys[i], temperature, top_p)
        token = jnp.where(ended, tokens[:, jnp.maximum(i - 1, 0)], token)  # an ended sequence repeats its stop id
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
        ended = ended | jnp.isin(token, stops)
        logits, cache = model.decode(token[:, None], cache)
        return i + 1, cache, logits[:, -1], tokens, ended

    start = (jnp.int32(0), cache, logits[:, -1], jnp.zeros((batch, max_new_tokens), jnp.int32), jnp.zeros((batch,), bool))
    steps, _, _, tokens, _ = jax.lax.while_loop(running, step, start)
    return tokens, steps


def compile_generate(loaded, prompt_shape: tuple[int, int], max_new_tokens: int, temperature: float, top_p: float, stop_ids=()):
    """The compiled program: (params, prompt ids, key) -> (new ids, tokens decoded)."""
    trainer = loaded.trainer

    def run(params, prompt, key):
        with installed(StepContext(layout=trainer.layout)):  # the layout only: decoding runs MoE layers densely, any batch
            model = nnx.merge(trainer.graphdef, params)
            return generate_ids(model, prompt, max_new_tokens, temperature=temperature, top_p=top_p, key=key, stop_ids=stop_ids)

    replicated = trainer.layout.replicated()
    jitted = jax.jit(run, in_shardings=(trainer.param_shardings, replicated, replicated), out_shardings=replicated)
    return jitted.lower(trainer.abstract_params(), jax.ShapeDtypeStruct(prompt_shape, jnp.int32), jax.random.key(0)).compile()


def stop_ids(config, step_dir, tokenizer) -> list[int]:
    """Where generation ends: the imported model's ``eos_token_id`` (its
    generation_config.json, else config.json: one id or several) and, when the run names
    its tokenizer, that tokenizer's end-of-document id."""
    ids = eos_ids(source_dir(config, step_dir))
    if tokenizer is not None and tokenizer.eod_id not in ids:
        ids.append(tokenizer.eod_id)
    return ids


def prompt_ids(prompt: str | None, ids_text: str | None, tokenizer, valid: int) -> list[int]:
    """The prompt's token ids: ``prompt`` (``--prompt``) encoded with the run's tokenizer,
    or ``ids_text`` (``--prompt-ids``, comma-separated); exactly one of the two. Every id
    must lie in ``0 .. valid - 1``."""
    if (prompt is None) == (ids_text is None):
        raise JaxdistError(ONE_PROMPT)
    if prompt is not None:
        if tokenizer is None:
            raise JaxdistError("the checkpoint names no tokenizer (converted without one): give --prompt-ids, or data.tokenizer=FILE")
        ids = [int(i) for i in tokenizer.encode_prompt(prompt)]
    else:
        try:
            ids = [int(x) for x in ids_text.split(",") if x.strip()]
        except ValueError:
            raise JaxdistError(f"--prompt-ids {ids_text!r}: expected comma-separated integers") from None
    return checked_ids(ids, valid)


def checked_ids(ids: list[int], valid: int) -> list[int]:
    if not ids:
        raise JaxdistError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < valid]
    if bad:
        raise JaxdistError(f"prompt ids {bad[:3]} are outside the model's vocab (0..{valid - 1})")
    return ids


def read_messages(path: str) -> list[dict]:
    """A conversation from a JSON file: a list of messages or ``{"messages": [...]}``."""
    try:
        value = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JaxdistError(f"--messages {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise JaxdistError(f"--messages {path}: unreadable JSON ({' '.join(str(e).split())[:200]})") from None
    messages = value.get("messages") if isinstance(value, dict) else value
    why = check_messages(messages)
    if why:
        raise JaxdistError(f'--messages {path}: {why} (expected [{{"role": ..., "content": ...}}, ...] or {{"messages": [...]}})')
    return messages


def chat_prompt(config: Config, tokenizer, messages: list[dict]) -> tuple[str, list[int], list[int]]:
    """(the conversation rendered with the chat template and its generation prompt, its ids,
    the ids that end the assistant's turn: the template's eos_token when it is one id)."""
    if tokenizer is None:
        raise JaxdistError("the checkpoint names no tokenizer (converted without one): a chat needs one (data.tokenizer=FILE)")
    if messages[-1]["role"] == "assistant":
        raise JaxdistError("the conversation ends with the assistant's message: nothing to answer (end it with a user message)")
    template = find_chat_template(config.data.chat_template, config.data.tokenizer)
    text = template.render(messages, add_generation_prompt=True)
    ids = [int(i) for i in tokenizer.encode(text)]  # the template writes the special tokens itself
    eos = dict(template.special_tokens).get("eos_token", "")
    eos_ids = [int(i) for i in tokenizer.encode(eos)] if eos else []
    return text, ids, eos_ids if len(eos_ids) == 1 else []


def generate(
    config: Config,
    step_dir: Path,
    *,
    prompt: str | None,
    ids_text: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    messages: list[dict] | None = None,
) -> dict[str, Any]:
    """Sample after the prompt from the checkpoint in ``step_dir`` (its ``config`` as
    ``jaxdist.inference.loading.load_config`` gives it): ``ids`` (the new tokens, the stop id
    cut off), ``text`` (None without a tokenizer), ``prompt_ids``, ``stop_ids``,
    ``decoded`` (tokens decoded) and ``checkpoint``; with ``messages`` (a conversation, instead
    of ``prompt`` / ``ids_text``) also ``chat_prompt``, the text the template rendered. Bad
    input raises JaxdistError before the checkpoint is read."""
    tokenizer = load_tokenizer(config.data.tokenizer) if config.data.tokenizer else None  # None: ids in, ids out
    m = config.model
    stops = stop_ids(config, step_dir, tokenizer)
    extra: dict[str, Any] = {}
    if messages is not None:
        if prompt is not None or ids_text is not None:
            raise JaxdistError(ONE_PROMPT)
        extra["chat_prompt"], ids, turn_end = chat_prompt(config, tokenizer, messages)
        ids = checked_ids(ids, m.valid_vocab or m.vocab_size)
        stops += [i for i in turn_end if i not in stops]
    else:
        ids = prompt_ids(prompt, ids_text, tokenizer, m.valid_vocab or m.vocab_size)
    loaded = load(config, step_dir, used_keys=("data.chat_template",) if messages is not None else ())
    compiled = compile_generate(loaded, (1, len(ids)), max_new_tokens, temperature, top_p, stops)
    tokens, steps = jax.device_get(compiled(loaded.params, np.asarray([ids], np.int32), jax.random.key(seed)))
    new = [int(i) for i in np.asarray(tokens)[0, : int(steps)]]
    ended = next((k for k, i in enumerate(new) if i in stops), None)
    if ended is not None:  # the stop id ends the text and is not part of it
        new = new[:ended]
    text = tokenizer.decode(new) if tokenizer is not None else None
    return {"ids": new, "text": text, "prompt_ids": ids, "stop_ids": stops, "decoded": int(steps), "checkpoint": str(step_dir), **extra}
