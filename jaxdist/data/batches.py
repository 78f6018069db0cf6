"""The Grain input pipeline: pack, split, shuffle, shard per process, batch, prefetch.

The global batch of step k is the same for any number of processes and workers:
examples are numbered globally (a seeded shuffle of fixed windows of the token
stream, repeated epoch after epoch with a new order each time); global batch k holds
examples [k*B, (k+1)*B); a process reads only the rows its devices hold, and Grain's
multiprocessing prefetch hands batches back in order whatever the worker count.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import numpy as np
from absl import flags

from jaxdist.cluster.lifetime import grain_worker_init
from jaxdist.config import Config
from jaxdist.data.chat import chat_splits
from jaxdist.data.loader import process_rows, to_global
from jaxdist.data.preference import preference_pairs
from jaxdist.data.sources import Corpus, TokenStream, open_corpus
from jaxdist.data.synthetic import SlowReads, SyntheticImages, SyntheticTokens
from jaxdist.errors import JaxdistError
from jaxdist.layout.sharding import Layout


def pack_window(window: np.ndarray, eod_id: int, document_mask: bool) -> dict[str, np.ndarray]:
    """One training example from seq_len + 1 consecutive stream tokens.

    Documents are joined by EOD in the stream. A token after an EOD starts a new segment
    (its position restarts at 0) and, with ``document_mask``, attends only within its
    segment; predicting across an EOD (the next document's first token) carries no loss.
    """
    inputs = window[:-1].astype(np.int32)
    is_eod = inputs == eod_id
    example = {"inputs": inputs, "targets": window[1:].astype(np.int32), "loss_mask": (~is_eod).astype(np.float32)}
    if document_mask:
        starts_segment = np.concatenate([[True], is_eod[:-1]])
        index = np.arange(len(inputs))
        example["segment_ids"] = np.cumsum(starts_segment, dtype=np.int32) - 1
        example["positions"] = (index - np.maximum.accumulate(np.where(starts_segment, index, 0))).astype(np.int32)
    return example


class PackedExamples:
    """Concatenate-and-chunk packing as a random-access source: example i is the window
    starting at token ``first + i * seq_len`` (windows share one token: i's last target
    is i+1's first input), so the inputs of all examples cover the stream exactly once."""

    def __init__(self, stream: TokenStream, first: int, n_examples: int, seq_len: int, eod_id: int, document_mask: bool):
        self.stream, self.first, self.n_examples = stream, first, n_examples
        self.seq_len, self.eod_id, self.document_mask = seq_len, eod_id, document_mask

    def __len__(self) -> int:
        return self.n_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = self.first + int(index) * self.seq_len
        return pack_window(self.stream.read(start, start + self.seq_len + 1), self.eod_id, self.document_mask)


def split_corpus(corpus: Corpus, config: Config) -> tuple[PackedExamples, PackedExamples]:
    """Train and eval examples: the last ``data.eval_fraction`` of the windows are eval.
    They start one token after the last training target (windows share a token at their
    seams), so no token of the held-out split is ever a training input or target."""
    seq_len, d = config.train.seq_len, config.data
    n_windows = (corpus.stream.n_tokens - 2) // seq_len  # seq_len + 1 tokens a window, and the one-token gap
    if n_windows < 2:
        raise JaxdistError(
            f"corpus {corpus.name} has {corpus.stream.n_tokens} tokens: shorter than two sequences of train.seq_len={seq_len} (one to train, one to evaluate)"
        )
    n_eval = min(max(1, round(n_windows * d.eval_fraction)), n_windows - 1)
    n_train = n_windows - n_eval

    def examples(first_token: int, n: int) -> PackedExamples:
        return PackedExamples(corpus.stream, first_token, n, seq_len, corpus.eod_id, d.document_mask)

    return examples(0, n_train), examples(n_train * seq_len + 1, n_eval)


def check_vocab(corpus: Corpus, config: Config) -> None:
    m = config.model
    if corpus.max_token_id >= (m.valid_vocab or m.vocab_size):
        which = f"model.valid_vocab ({m.valid_vocab}; ids above are padding)" if m.valid_vocab else f"model.vocab_size ({m.vocab_size})"
        raise JaxdistError(f"token id {corpus.max_token_id} in {corpus.name} >= {which}; the tokenizer needs {corpus.vocab_size}")


def example_source(config: Config, split: str) -> Any:
    """The random-access source of one split (train or eval)."""
    m, t = config.model, config.train
    if config.data.source == "synthetic":
        if m.kind == "resnet":
            source = SyntheticImages(m.image_size, m.num_classes, seed=t.seed, split=split)
        else:
            source = SyntheticTokens(m.valid_vocab or m.vocab_size, t.seq_len, seed=t.seed, split=split)
        return SlowReads(source, config.data.synthetic_latency_ms / 1000) if config.data.synthetic_latency_ms else source
    if m.kind == "resnet":
        raise JaxdistError(f"model.kind=resnet trains on data.source=synthetic images, not {config.data.source!r}")
    if config.data.source == "preference":  # chosen/rejected pairs, two rows an example (train.objective=dpo)
        if split != "train":
            raise JaxdistError("data.source=preference has no held-out split yet (train.eval_every=0)")
        return preference_pairs(config)
    if config.data.source == "chat":  # conversations packed whole, the loss on the assistant's tokens
        train, evaluation = chat_splits(config)
        return train if split == "train" else evaluation
    corpus = open_corpus(config)
    check_vocab(corpus, config)
    train, evaluation = split_corpus(corpus, config)
    return train if split == "train" else evaluation


@dataclasses.dataclass(frozen=True)
class ProcessSlice:
    """Which rows of each global batch this process feeds: ``block`` of ``blocks``."""

    global_batch: int
    rows: int
    block: int

    @property
    def blocks(self) -> int:
        return self.global_batch // self.rows

    @classmethod
    def for_layout(cls, layout: Layout, global_batch: int) -> ProcessSlice:
        rows = process_rows(layout.batch_sharding(1), (global_batch,))
        count = rows.stop - rows.start
        if rows.start % count:
            raise ValueError(f"process rows {rows} are not an aligned block of the batch")
        return cls(global_batch, count, rows.start // count)


def batches_dataset(source: Any, part: ProcessSlice, *, seed: int, shuffle: bool) -> grain.MapDataset:
    """Element k: this process's rows of global batch k (endless; reshuffled each epoch). A
    source whose examples are several rows (``rows_per_example``: preference pairs) is shuffled
    and batched by example, then flattened, so an example's rows stay adjacent."""
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    per_example = getattr(source, "rows_per_example", 1)
    if part.rows % per_example:
        raise JaxdistError(f"{part.rows} batch rows per process would split an example of {per_example} rows")
    ds = ds.repeat(None).batch(part.rows // per_example, drop_remainder=True)
    if per_example > 1:
        ds = ds.map(_flatten_examples)
    return ds[part.block :: part.blocks]


def _flatten_examples(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """[examples, rows per example, ...] -> [rows, ...]."""
    return {key: value.reshape(-1, *value.shape[2:]) for key, value in batch.items()}


def read_threads(source: Any, prefetch: int) -> int:
    """Grain's read threads: only for a source whose reads wait (``SlowReads``: simulated
    storage latency; token shards in object storage), where threads overlap the waits. Packing
    and synthetic examples are Python that holds the GIL: threads beside the read-ahead thread
    only take it from the loop (measured: experiments/data_throughput.py)."""
    waits = isinstance(source, SlowReads) or getattr(getattr(source, "stream", None), "reads_wait", False)
    return max(1, min(prefetch, 8)) if waits else 0


def _mark_absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside ``absl.app`` nobody parsed them."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class DataStateMismatch(ValueError):
    """A saved data state that this iterator cannot continue from (e.g. another worker count)."""


def split_data_state(state: dict) -> tuple[int, int | None, dict]:
    """A saved data state -> (start step, worker count or None if unknown, Grain's state).

    Older checkpoints stored Grain's state alone: it starts at step 0 and its worker
    count shows in its shape (multiprocessing prefetch interleaves one iterator per worker).
    """
    if "grain" in state:
        return int(state.get("start_step", 0)), state.get("workers"), state["grain"]
    if "next_index" in state:
        return 0, 0, state
    return 0, len(state.get("iterators_in_use_states", ())) or None, state


class BatchIterator:
    """Global ``jax.Array`` batches from this process's Grain iterator.

    A background thread reads, packs and transfers batches ``prefetch`` steps ahead: what
    ``next`` returns is a finished item (device arrays, segment ids and positions
    included) taken off a queue. Each queued batch carries the Grain state after it, so
    ``get_state`` describes what the loop consumed, not what was read ahead.

    The thread's Python work holds the GIL; the loop waits for it whenever it gives the
    GIL up while the thread runs (it wakes when the loop takes a batch). So the thread
    does as little Python as it can (one transfer call a batch, no Grain read threads
    beside it for sources that compute rather than wait: ``read_threads``).

    The state is absolute: Grain's position inside the dataset sliced at ``start_step``
    (the step the iterator was opened at) together with that step, so it continues the
    same stream whichever slice the restoring iterator was opened at.
    """

    def __init__(
        self,
        open_dataset: Callable[[int], grain.IterDataset],
        layout: Layout,
        global_batch: int,
        prefetch: int = 2,
        *,
        start_step: int = 0,
        workers: int = 0,
    ):
        self._open, self.start_step, self.workers = open_dataset, start_step, workers
        self._iterator = iter(open_dataset(start_step))
        self.layout, self.global_batch, self.prefetch = layout, global_batch, prefetch
        self._state = self._iterator.get_state()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self.prefetch == 0:
            batch = to_global(next(self._iterator), self.layout, self.global_batch)
            self._state = self._iterator.get_state()
            return batch
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._thread = None
            raise item
        batch, self._state = item
        return batch

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True, name="jaxdist-prefetch")
        self._thread.start()

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                batch = to_global(next(self._iterator), self.layout, self.global_batch)
                out.put((batch, self._iterator.get_state()))  # blocks while full; no polling wake-ups
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            out.put(e)

    def _stop_reading_ahead(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():  # empty the queue so that a blocked put returns and the thread sees the stop
                with contextlib.suppress(queue.Empty):
                    self._queue.get(timeout=0.05)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop reading ahead and shut down Grain's worker processes, if any."""
        self._stop_reading_ahead()
        if hasattr(self._iterator, "close"):
            self._iterator.close()

    def get_state(self) -> dict:
        return {"start_step": self.start_step, "workers": self.workers, "grain": copy.deepcopy(self._state)}

    def set_state(self, state: dict) -> None:
        """Continue from ``get_state``'s output (of this iterator or one opened at another
        step); raises ``DataStateMismatch`` for a state of another worker count."""
        start_step, workers, grain_state = split_data_state(state)
        if workers is not None and workers != self.workers:
            raise DataStateMismatch(f"saved with data.workers={workers}, this run reads with {self.workers}")
        self._stop_reading_ahead()
        if start_step != self.start_step:  # reopen the same slice the saving iterator read
            self.close()
            self._iterator, self.start_step = iter(self._open(start_step)), start_step
        self._iterator.set_state(grain_state)
        self._state = copy.deepcopy(grain_state)


def make_iterator(
    config: Config, layout: Layout, *, split: str = "train", start_step: int = 0, workers: int | None = None
) -> BatchIterator:
    """Batches for steps start_step+1, start_step+2, ... of ``split`` (``workers``
    overrides ``data.workers``)."""
    d = config.data
    shuffle = split == "train" and d.shuffle and d.source != "synthetic"  # synthetic examples are random already
    return _batch_iterator(config, layout, example_source(config, split), shuffle=shuffle, start_step=start_step, workers=workers)


def _batch_iterator(config: Config, layout: Layout, source: Any, *, shuffle: bool, start_step: int = 0, workers: int | None = None):
    d, t = config.data, config.train
    part = ProcessSlice.for_layout(layout, t.global_batch)
    batches = batches_dataset(source, part, seed=t.seed, shuffle=shuffle)
    workers = d.workers if workers is None else workers
    read_options = grain.ReadOptions(num_threads=read_threads(source, d.prefetch), prefetch_buffer_size=d.prefetch)

    def open_dataset(start: int) -> grain.IterDataset:
        iter_ds = (batches[start:] if start else batches).to_iter_dataset(read_options)
        if workers > 0:
            _mark_absl_flags_parsed()
            options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=max(1, d.prefetch))
            iter_ds = iter_ds.mp_prefetch(options, worker_init_fn=grain_worker_init())  # workers die with this process
        return iter_ds

    return BatchIterator(open_dataset, layout, t.global_batch, prefetch=d.prefetch, start_step=start_step, workers=workers)


class PaddedExamples:
    """A finite split padded to whole batches: the examples past its end are padding
    (every field zero, ``loss_mask`` included), so each real example is scored once and
    the padding adds neither loss nor tokens."""

    def __init__(self, source: Any, length: int):
        self.source, self.length = source, length
        self.rows_per_example = getattr(source, "rows_per_example", 1)  # preference pairs: two rows, kept together

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if index < len(self.source):
            return self.source[index]
        return {key: np.zeros_like(value) for key, value in self.source[0].items()}


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The held-out split as eval reads it."""

    source: Any  # the eval examples, padded to ``batches`` whole batches
    batches: int  # batches scored: as many as hold the split, at most train.eval_batches
    examples: int | None  # real (unpadded) examples in them; None: synthetic, endless
    asked: int  # train.eval_batches


def held_out(config: Config) -> HeldOut:
    """Every held-out window once, in order, in at most ``train.eval_batches`` batches."""
    source, asked, per_batch = example_source(config, "eval"), config.train.eval_batches, config.train.global_batch
    if config.data.source == "synthetic":  # endless: every batch is new
        return HeldOut(source, asked, None, asked)
    batches = min(asked, -(-len(source) // per_batch))
    return HeldOut(PaddedExamples(source, batches * per_batch), batches, min(len(source), batches * per_batch), asked)


def eval_batches(config: Config, layout: Layout, split: HeldOut | None = None) -> Iterator[dict[str, jax.Array]]:
    """The held-out batches every periodic eval sees (the same ones each time; each
    window once, the last batch padded)."""
    split = held_out(config) if split is None else split
    iterator = _batch_iterator(config, layout, split.source, shuffle=False, workers=0)
    try:
        for _ in range(split.batches):
            yield next(iterator)
    finally:
        iterator.close()
