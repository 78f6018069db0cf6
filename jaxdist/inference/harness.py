"""A jaxdist model for lm-evaluation-harness (``jaxdist eval --tasks``).

lm-eval asks a model three things, each a list of requests: the log-likelihood of a
continuation after a context (and whether greedy decoding would produce it), the
log-likelihood of a whole text in windows of the model's context (``loglikelihood_rolling``),
and greedy text after a context until a stop string. ``Scorer`` answers them in token ids on
the run's mesh; ``adapter`` wraps it as lm-eval's ``TemplateLM``, which turns text into ids
the way lm-eval's Hugging Face backend does (a context's trailing spaces move to the
continuation; an empty context is the end-of-text id).

Requests run in batches of fixed shapes: ``batch_size`` rows (a multiple of the mesh's batch
shards; the last batch filled with empty rows) of a bucketed length (the next power of two
from 16, at most the model's context ``train.seq_len``), right-padded, so a handful of programs
serve every request. The batch is split over the batch axes (``data``, ``fsdp``) like a
training batch. Log-likelihood requests are packed: several short ones share a row as
documents of their own (positions from 0, segment ids that keep attention inside each), up to
the packed attention's documents per row (``models.attention.default_max_segments``), so an
evaluation of short multiple-choice requests runs a fraction of the rows. Greedy generation recomputes the whole padded sequence for each new token
(rows of different lengths in one batch need no cache alignment), ``GEN_CHUNK`` tokens per
call, and stops once every row has produced the end-of-text id or one of its stop strings.

Importing this module does not import lm-eval (an optional extra, ``pip install jaxdist[eval]``):
``adapter`` and ``run_tasks`` import it when called.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.errors import JaxdistError
from jaxdist.layout.step_context import installed
from jaxdist.models.attention import default_max_segments

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # the shortest padded length
GEN_CHUNK = 16  # greedy tokens per compiled call
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
NOT_INSTALLED = "lm-evaluation-harness is not installed: pip install 'jaxdist[eval]' (or lm-eval>=0.4.13)"


def bucket(n: int, limit: int) -> int:
    """The padded length of a row of ``n`` tokens: the next power of two from MIN_BUCKET, at most ``limit``."""
    size = MIN_BUCKET
    while size < n:
        size *= 2
    return max(n, min(size, limit))


class Scorer:
    """Token-level answers for one model on one mesh: ``trainer`` (its graph, layout and
    parameter shardings) and ``params`` (in those shardings; the live ones during training)."""

    def __init__(self, trainer: Any, params: Any, max_length: int, batch_size: int):
        shards = _batch_shards(trainer.layout)
        self.trainer, self.params, self.max_length = trainer, params, max_length
        self.batch_size = -(-max(batch_size, 1) // shards) * shards  # a multiple of the batch shards
        rows, per_row = trainer.layout.batch_sharding(2), trainer.layout.batch_sharding(1)
        replicated = trainer.layout.replicated()
        self._rows, self._per_row = rows, per_row
        self._score = jax.jit(self._score_fn, in_shardings=(trainer.param_shardings, *[rows] * 5), out_shardings=replicated)
        self.rows_scored = 0  # rows of log-likelihood batches run, filler rows included
        self._extend = jax.jit(
            self._extend_fn, in_shardings=(trainer.param_shardings, rows, per_row), out_shardings=(replicated, replicated)
        )

    # -- the compiled programs ------------------------------------------------------------

    def _logits(self, params, inputs, positions=None, segment_ids=None):
        with installed(self.trainer.context()):
            return nnx.merge(self.trainer.graphdef, params)(inputs, positions, segment_ids).astype(jnp.float32)

    def _score_fn(self, params, inputs, targets, mask, positions, segment_ids):
        """Each masked target's log-probability (0 elsewhere), and whether each target is the
        argmax or unmasked: per token, for the requests packed in a row to be summed apart."""
        logits = self._logits(params, inputs, positions, segment_ids)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        greedy = jnp.argmax(logits, axis=-1) == targets
        return jnp.where(mask, picked, 0.0), greedy | ~mask

    def _extend_fn(self, params, tokens, lengths):
        """GEN_CHUNK greedy tokens appended after each row's ``lengths`` tokens (a full row stays as it is)."""
        rows = jnp.arange(tokens.shape[0])

        def step(_, carry):
            tokens, lengths = carry
            logits = self._logits(params, tokens)
            nxt = jnp.argmax(logits[rows, jnp.maximum(lengths - 1, 0)], axis=-1).astype(tokens.dtype)
            room = lengths < tokens.shape[1]
            tokens = tokens.at[rows, lengths].set(nxt, mode="drop")
            return tokens, lengths + room.astype(lengths.dtype)

        return jax.lax.fori_loop(0, GEN_CHUNK, step, (tokens, lengths))

    def _put(self, array: np.ndarray) -> jax.Array:
        """A host array every process holds whole, split over the batch axes."""
        sharding = self._rows if array.ndim == 2 else self._per_row
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    # -- requests -------------------------------------------------------------------------

    def _batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Request indices in batches of at most ``batch_size``, longest first (each batch one bucket)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return [order[k : k + self.batch_size] for k in range(0, len(order), self.batch_size)]

    def loglikelihood(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """For each (context ids, continuation ids): the continuation's summed log-probability
        after the context and whether greedy decoding gives it. A context that, with the
        continuation, exceeds the model's context loses its start."""
        rows = []
        for context, continuation in requests:
            if not continuation:
                raise JaxdistError("a log-likelihood request has an empty continuation")
            if not context:
                raise JaxdistError("a log-likelihood request has an empty context")
            if len(continuation) > self.max_length:
                raise JaxdistError(f"a continuation of {len(continuation)} tokens is longer than the model's context ({self.max_length})")
            whole = [*context, *continuation][-(self.max_length + 1) :]
            rows.append((whole, len(continuation)))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for width, packed in self._packed_batches([len(whole) - 1 for whole, _ in rows]):
            arrays = {k: np.zeros((self.batch_size, width), t) for k, t in (("inputs", np.int32), ("targets", np.int32), ("mask", bool))}
            positions = np.zeros((self.batch_size, width), np.int32)
            segments = np.ones((self.batch_size, width), np.int32)
            spans = []
            for r, members in enumerate(packed):
                start = 0
                for segment, i in enumerate(members, start=1):
                    whole, n = rows[i]
                    end = start + len(whole) - 1
                    arrays["inputs"][r, start:end], arrays["targets"][r, start:end] = whole[:-1], whole[1:]
                    arrays["mask"][r, end - n : end] = True
                    positions[r, start:end], segments[r, start:end] = np.arange(end - start), segment
                    spans.append((i, r, end - n, end))
                    start = end
                segments[r, start:] = len(members) + 1  # the padding: a document of its own, ids non-decreasing
            picked, greedy = jax.device_get(self._score(self.params, *(self._put(a) for a in (*arrays.values(), positions, segments))))
            self.rows_scored += self.batch_size
            for i, r, a, b in spans:
                out[i] = (float(np.sum(picked[r, a:b])), bool(np.all(greedy[r, a:b])))
        return out

    def _packed_batches(self, lengths: Sequence[int]) -> list[tuple[int, list[list[int]]]]:
        """Requests of ``lengths`` tokens packed into batches: (row width, each row's request
        indices). Longest first; a batch's width is its first request's bucket, and each later
        request goes in the first row with room for it (tokens, and documents per row for the
        packed attention), else in a new row while the batch has one."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[tuple[int, list[list[int]]]] = []
        used: list[int] = []  # tokens in each row of the last batch
        for i in order:
            if batches:
                width, packed = batches[-1]
                fits = (r for r, row in enumerate(packed) if used[r] + lengths[i] <= width and len(row) < default_max_segments(width))
                r = next(fits, None)
                if r is None and len(packed) < self.batch_size:
                    r = len(packed)
                    packed.append([])
                    used.append(0)
                if r is not None:
                    packed[r].append(i)
                    used[r] += lengths[i]
                    continue
            batches.append((bucket(lengths[i], self.max_length), [[i]]))
            used = [lengths[i]]
        return batches

    def greedy(
        self, contexts: Sequence[Sequence[int]], max_new: int, stop_ids: Sequence[int], done: Callable[[int, list[int]], bool]
    ) -> list[list[int]]:
        """Greedy ids after each context (its start cut so that ``max_new`` tokens fit the
        model's context), at most ``max_new``, ending before the first of ``stop_ids``;
        ``done(i, ids)`` says whether request ``i``'s ids so far already hold a stop string."""
        room = self.max_length - max_new
        if room < 1:
            raise JaxdistError(f"max_gen_toks {max_new} leaves no room for a context in the model's {self.max_length} tokens")
        contexts = [list(c)[-room:] for c in contexts]
        if any(not c for c in contexts):
            raise JaxdistError("a generation request has an empty context")
        out: list[list[int]] = [[] for _ in contexts]
        for batch in self._batches([len(c) for c in contexts]):
            width = bucket(len(contexts[batch[0]]) + max_new, self.max_length)
            tokens = np.zeros((self.batch_size, width), np.int32)
            lengths = np.ones((self.batch_size,), np.int32)  # filler rows: one token
            for r, i in enumerate(batch):
                tokens[r, : len(contexts[i])] = contexts[i]
                lengths[r] = len(contexts[i])
            start, finished = lengths.copy(), [False] * len(batch)
            while not all(finished):
                tokens, lengths = (np.asarray(x) for x in jax.device_get(self._extend(self.params, self._put(tokens), self._put(lengths))))
                tokens, lengths = tokens.copy(), lengths.copy()
                for r, i in enumerate(batch):
                    new = [int(t) for t in tokens[r, start[r] : lengths[r]]][:max_new]
                    ended = next((k for k, t in enumerate(new) if t in stop_ids), None)
                    out[i] = new if ended is None else new[:ended]
                    finished[r] = ended is not None or len(new) >= max_new or lengths[r] >= width or done(i, out[i])
        return out


def _batch_shards(layout: Any) -> int:
    spec = layout.batch_sharding(2).spec[0]
    axes = spec if isinstance(spec, tuple) else (spec,)
    return int(np.prod([layout.mesh.shape[a] for a in axes if a is not None]))


@dataclasses.dataclass
class HarnessText:
    """What turns text into ids and back: the run's tokenizer (its ``eod_id`` is lm-eval's
    end-of-text id) and chat template (None: the run has none)."""

    tokenizer: Any
    chat_template: Any = None
    name: str = "jaxdist"


class _Adapter:
    """lm-eval's ``TemplateLM`` methods for a ``Scorer`` (mixed in by ``adapter``)."""

    backend = "causal"

    def __init__(self, scorer: Scorer, text: HarnessText, max_gen_toks: int = 256):
        super().__init__()
        self.scorer, self.text, self.max_gen_toks = scorer, text, max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return int(self.text.tokenizer.eod_id)

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return [int(i) for i in self.text.tokenizer.encode(string)]

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.text.tokenizer.decode(list(ids))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.scorer.loglikelihood([(context, continuation) for _, context, continuation in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        windows, owner = [], []
        for k, request in enumerate(requests):
            ids = self.tok_encode(request.args[0])
            for context, continuation in map(
                utils.make_disjoint_window, utils.get_rolling_token_windows(ids, self.eot_token_id, self.max_length, 1)
            ):
                windows.append((context, continuation))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self.scorer.loglikelihood(windows), strict=True):
            totals[k] += logp
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        eos = self.tok_decode([self.eot_token_id])
        groups: dict[tuple, list[int]] = {}
        settings = []
        for k, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") and kwargs.get("temperature", 0) > 0:
                log.info("a generation request asks for sampling: decoding is greedy here")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos or None)
            settings.append((context, until))
            groups.setdefault((int(kwargs["max_gen_toks"]),), []).append(k)
        texts = [""] * len(requests)
        for (max_new,), members in groups.items():
            contexts = [self.tok_encode(settings[k][0]) for k in members]

            def done(i: int, ids: list[int], members=members) -> bool:
                text = self.tok_decode(ids)
                return any(stop and stop in text for stop in settings[members[i]][1])

            for k, ids in zip(members, self.scorer.greedy(contexts, max_new, [self.eot_token_id], done), strict=True):
                text = self.tok_decode(ids)
                for stop in settings[k][1]:
                    if stop:
                        text = text.split(stop)[0]
                texts[k] = text
                self.cache_hook.add_partial("generate_until", requests[k].args, text)
        return texts

    @property
    def tokenizer_name(self) -> str:
        return self.text.name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if self.text.chat_template is None:
            raise JaxdistError("--apply-chat-template: the run has no chat template (data.chat_template=FILE, or one beside its tokenizer)")
        return self.text.chat_template.text

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.text.chat_template is None:
            self.chat_template()
        return self.text.chat_template.render(chat_history, add_generation_prompt=add_generation_prompt)


def adapter(scorer: Scorer, text: HarnessText, max_gen_toks: int = 256) -> Any:
    """An lm-eval model (``lm_eval.api.model.TemplateLM``) answering with ``scorer``."""
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise JaxdistError(NOT_INSTALLED) from None
    cls = type("JaxdistLM", (_Adapter, TemplateLM), {})
    return cls(scorer, text, max_gen_toks)


def go_offline() -> None:
    """Nothing may be downloaded: a task whose data are not local fails (set before lm-eval loads ``datasets``)."""
    os.environ.update(OFFLINE)
    datasets = sys.modules.get("datasets")
    if datasets is not None and hasattr(datasets, "config"):
        datasets.config.HF_DATASETS_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def task_manager(tasks: Sequence[str], include_path: str | None = None) -> Any:
    """lm-eval's ``TaskManager`` that knows every one of ``tasks`` (names: lm-eval's registry's,
    or those of the YAML files under ``include_path``), loading nothing but local data: an
    unknown task, a missing ``include_path`` or lm-eval not installed raise JaxdistError (one line)."""
    go_offline()
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise JaxdistError(NOT_INSTALLED) from None
    if not tasks:
        raise JaxdistError("--tasks: no task named")
    if include_path is not None and not os.path.isdir(include_path):
        raise JaxdistError(f"--include-path {include_path}: no such directory")
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)  # lm-eval's registry too (indexing it takes seconds)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor under --include-path {include_path}" if include_path else " (give --include-path DIR for tasks of your own)"
        raise JaxdistError(f"unknown task(s) {', '.join(unknown)}: not in lm-eval's registry{where}")
    load = manager.load

    def load_offline(names):
        try:
            return load(names)
        except JaxdistError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever loading a task's data raises is one line
            raise JaxdistError(
                f"task(s) {', '.join(tasks)}: their data could not be loaded without a download (nothing is downloaded here; "
                f"make the data local, e.g. dataset_path: json with data_files): {_one_line(e)}"
            ) from None

    manager.load = load_offline
    return manager


def run_tasks(
    lm: Any,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: int | None = None,
    apply_chat_template: bool = False,
    manager: Any = None,
) -> dict[str, dict[str, float]]:
    """Run lm-eval ``tasks`` on ``lm`` (``adapter``): {task: {metric: value}}, a metric's filter
    after a comma when it is not ``none`` (``exact_match,strict-match``), standard errors as
    ``METRIC_stderr``. Nothing is downloaded (``task_manager``; ``manager``: one made before)."""
    manager = manager or task_manager(tasks, include_path)
    from lm_eval import simple_evaluate

    out = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        apply_chat_template=apply_chat_template,
        bootstrap_iters=0,
    )
    return {task: _metrics(values) for task, values in out["results"].items()}


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    metrics = {}
    for key, value in values.items():
        if "," not in key or isinstance(value, str) or value is None:
            continue
        metric, _, filter_name = key.partition(",")
        name = metric if filter_name == "none" else f"{metric},{filter_name}"
        metrics[name] = float(value)
    return metrics


def write_results(step_dir: Any, result: dict[str, Any]) -> Any:
    """``RUN_DIR/eval/STEP.json`` (merged with what an earlier evaluation of that step wrote) when
    ``step_dir`` is a run's ``checkpoints/STEP`` (or weights-only ``params/STEP``); the path written, or None outside a run."""
    step_dir = Path(step_dir)
    if step_dir.parent.name not in ("checkpoints", "params") or not step_dir.name.isdigit():
        return None
    return write_step_results(step_dir.parent.parent, int(step_dir.name), result)


def write_step_results(run_dir: Any, step: int, result: dict[str, Any]) -> Path:
    """``run_dir/eval/STEP.json``, merged with what an earlier evaluation of that step wrote."""
    path = Path(run_dir) / "eval" / f"{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    tasks = {**old.get("tasks", {}), **result["tasks"]} if isinstance(old, dict) else result["tasks"]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**result, "tasks": tasks}, indent=1) + "\n")
    tmp.replace(path)
    return path
