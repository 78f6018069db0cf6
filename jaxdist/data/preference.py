"""``data.source=preference``: chosen/rejected pairs for ``train.objective=dpo``.

Each record of ``data.path`` (JSON Lines ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, or Parquet;
local paths, globs, folders or URLs as every corpus takes them) holds ``prompt``, ``chosen`` and
``rejected``:

- text: three strings. The prompt and each answer are tokenised apart (as TRL does) and the
  end-of-document id closes each answer;
- chat: ``prompt`` a list of messages, each answer a list of messages (the assistant's turn) or
  a string (its content). The prompt is rendered with the chat template of ``data.source=chat``
  and its generation prompt; an answer is what the whole conversation adds to that text (a
  template that rewrites the prompt's text once answered is refused in one line).

A pair is two rows, chosen then rejected, each ``prompt + answer`` from position 0 with the loss
mask on the answer's tokens only, the rest of the row padding (a segment of its own, no loss).
The pair is one example of the Grain source (``rows_per_example``), so shuffling, process
slicing and batching never part it: global batch rows 2i and 2i+1 are pair i. With
``data.reference_logps`` each row also carries its stored reference log-probability
(``data.reference_logps``'s file).

An answer longer than the row leaves is cut (counted in the log line). A record without one of
the fields, a field of the wrong type, an empty side, or a prompt that leaves no room for an
answer token in ``train.seq_len`` is a bad record: it stops the read with one line, or with
``data.bad_records=skip`` is skipped and counted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Iterator

import numpy as np

from jaxdist.config import Config
from jaxdist.data import reference_logps
from jaxdist.data.chat_template import ChatTemplate, check_messages, find_chat_template
from jaxdist.data.records import JSONL_SUFFIXES, PARQUET_SUFFIXES, RecordReading, jsonl_lines
from jaxdist.data.text import expand_inputs
from jaxdist.data.tokenizers import Tokenizer, load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import open_binary

log = logging.getLogger(__name__)
FIELDS = ("prompt", "chosen", "rejected")


def check_record(value) -> str | None:
    """Why ``value`` is not a preference record (None when it is)."""
    if not isinstance(value, dict):
        return "not a JSON object"
    for field in FIELDS:
        if field not in value or value[field] is None:
            return f"no field '{field}'"
    chat = isinstance(value["prompt"], list)
    for field in FIELDS:
        item = value[field]
        if isinstance(item, str):
            if not item.strip():
                return f"field '{field}' is empty"
        elif not isinstance(item, list):
            return f"field '{field}' is {type(item).__name__}, not a string or a list of messages"
        elif not chat:
            return f"field '{field}' is a list of messages but 'prompt' is text: give all three as text, or the prompt as messages"
        elif not item:
            return f"field '{field}' is empty"
        elif why := check_messages(item):
            return f"field '{field}': {why}"
    return None


def preference_records(files, reading: RecordReading) -> Iterator[tuple[dict, str, str]]:
    """(record, file, record number) of every good record; a bad one goes to ``reading``."""
    for path in files:
        name = str(path).lower()
        if name.endswith(PARQUET_SUFFIXES):
            yield from _parquet_records(path, reading)
        elif name.endswith(JSONL_SUFFIXES):
            yield from _jsonl_records(path, reading)
        else:
            raise JaxdistError(f"{path}: data.source=preference reads JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files")


def _jsonl_records(path, reading: RecordReading) -> Iterator[tuple[dict, str, str]]:
    try:
        for record, line in jsonl_lines(path, reading):
            try:
                value = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                reading.bad(path, record, f"not UTF-8 (byte {e.start})")
                continue
            except json.JSONDecodeError as e:
                reading.bad(path, record, f"not JSON ({e.msg})")
                continue
            why = check_record(value)
            if why:
                reading.bad(path, record, why)
            else:
                yield value, str(path), str(record)
    except OSError as e:
        raise JaxdistError(f"cannot read input file {path}: {e.strerror or e}") from None


def _parquet_records(path, reading: RecordReading) -> Iterator[tuple[dict, str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise JaxdistError(f"{path}: reading Parquet needs the pyarrow package (pip install 'jaxdist[storage]')") from None
    with open_binary(path) as source:
        try:
            parquet = pq.ParquetFile(source)
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
            raise JaxdistError(f"{path}: not a readable Parquet file ({e})") from None
        missing = [f for f in FIELDS if f not in parquet.schema_arrow.names]
        if missing:
            raise JaxdistError(f"{path}: no column '{missing[0]}' (columns: {', '.join(parquet.schema_arrow.names[:8])})")
        record = 0
        for group in range(parquet.num_row_groups):
            for value in parquet.read_row_group(group, columns=list(FIELDS)).to_pylist():
                record += 1
                value = {k: _plain_messages(v) for k, v in value.items()}
                why = check_record(value)
                if why:
                    reading.bad(path, record, why)
                else:
                    yield value, str(path), str(record)


def _plain_messages(value):
    """A struct column fills fields a message lacks with None: drop them (``content`` stays)."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in m.items() if v is not None or k == "content"} if isinstance(m, dict) else m for m in value]


@dataclasses.dataclass
class Encoder:
    """Records -> token ids (prompt, chosen, rejected); the chat template is found at the first chat record."""

    tokenizer: Tokenizer
    template_file: str
    tokenizer_path: str

    @functools.cached_property
    def template(self) -> ChatTemplate:
        return find_chat_template(self.template_file, self.tokenizer_path)

    def encode(self, value: dict, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | str:
        """The three token arrays, or why the record cannot be rendered."""
        if isinstance(value["prompt"], str):
            eod = [self.tokenizer.eod_id]
            prompt = np.asarray(self.tokenizer.encode(value["prompt"]), np.int64)
            answers = [np.concatenate([np.asarray(self.tokenizer.encode(value[f]), np.int64), eod]) for f in FIELDS[1:]]
            return prompt, *answers
        prompt_text = self.template.render(value["prompt"], add_generation_prompt=True, where=where)
        answers = []
        for field in FIELDS[1:]:
            turn = value[field] if isinstance(value[field], list) else [{"role": "assistant", "content": value[field]}]
            whole = self.template.render([*value["prompt"], *turn], where=where)
            if not whole.startswith(prompt_text):
                return (
                    f"the chat template does not render the prompt (with its generation prompt) as the start of the '{field}' conversation"
                )
            answers.append(np.asarray(self.tokenizer.encode(whole[len(prompt_text) :]), np.int64))
        return np.asarray(self.tokenizer.encode(prompt_text), np.int64), *answers


class PreferencePairs:
    """Tokenised pairs as a random-access source: example i is pair i's two rows, arrays
    [2, seq_len] (chosen, rejected); pickles as its arrays, for Grain's workers."""

    rows_per_example = 2  # batches_dataset batches pairs and flattens them to rows

    def __init__(self, tokens, offsets, prompt_lengths, seq_len: int, document_mask: bool, reference: np.ndarray | None = None):
        # sequence 2i (chosen) and 2i+1 (rejected) of pair i: tokens[offsets[j]:offsets[j+1]], prompt_lengths[j] of them the prompt
        self.tokens, self.offsets, self.prompt_lengths = tokens, offsets, prompt_lengths
        self.seq_len, self.document_mask = seq_len, document_mask
        self.reference = reference  # each row's stored reference log-probability (data.reference_logps), or None

    def digest(self) -> str:
        return reference_logps.pairs_digest(self.tokens, self.offsets, self.prompt_lengths, self.seq_len)

    def with_reference(self, logps: np.ndarray) -> PreferencePairs:
        return PreferencePairs(self.tokens, self.offsets, self.prompt_lengths, self.seq_len, self.document_mask, logps)

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // 2

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        seq = self.seq_len
        inputs, targets = np.zeros((2, seq), np.int32), np.zeros((2, seq), np.int32)
        loss_mask, segment_ids, positions = np.zeros((2, seq), np.float32), np.zeros((2, seq), np.int32), np.zeros((2, seq), np.int32)
        for side in range(2):
            j = 2 * int(index) + side
            row = self.tokens[self.offsets[j] : self.offsets[j + 1]]
            n = len(row) - 1
            inputs[side, :n], targets[side, :n] = row[:-1], row[1:]
            loss_mask[side, self.prompt_lengths[j] - 1 : n] = 1.0  # target t is token t + 1: the answer's tokens
            segment_ids[side, n:], positions[side] = 1, np.concatenate([np.arange(n), np.arange(seq - n)])
        example = {"inputs": inputs, "targets": targets, "loss_mask": loss_mask}
        if self.document_mask:
            example |= {"segment_ids": segment_ids, "positions": positions}
        if self.reference is not None:
            example[reference_logps.KEY] = self.reference[2 * int(index) : 2 * int(index) + 2]
        return example


def preference_pairs(config: Config, *, with_reference: bool = True) -> PreferencePairs:
    """The training pairs of ``data.source=preference``; with ``data.reference_logps`` (and
    ``with_reference``) each row with its stored reference log-probability."""
    d, t = config.data, config.train
    if not d.path:
        raise JaxdistError(
            'data.source=preference needs data.path (JSON Lines of {"prompt", "chosen", "rejected"}: files, globs or a directory)'
        )
    pairs, max_id = _pairs(
        tuple(str(f) for f in expand_inputs(d.path)),
        "" if d.tokenizer == "byte" else d.tokenizer,
        d.chat_template,
        d.bad_records,
        t.seq_len,
        d.document_mask,
    )
    m = config.model
    if max_id >= (m.valid_vocab or m.vocab_size):
        raise JaxdistError(f"token id {max_id} in preference:{d.path} >= the model's vocab ({m.valid_vocab or m.vocab_size})")
    if with_reference and d.reference_logps and config.train.objective == "dpo":
        try:
            logps, _ = reference_logps.read(d.reference_logps, pairs.digest(), 2 * len(pairs))
        except FileNotFoundError:
            raise JaxdistError(f"data.reference_logps {d.reference_logps}: no such file") from None
        return pairs.with_reference(logps)
    return pairs


@functools.cache  # every iterator of a process shares one tokenisation
def _pairs(files, tokenizer_path, template_file, bad_records, seq_len, document_mask) -> tuple[PreferencePairs, int]:
    tokenizer = load_tokenizer(tokenizer_path or None)
    encoder = Encoder(tokenizer, template_file, tokenizer_path)
    reading = RecordReading("prompt", bad_records)
    sequences, prompt_lengths, records, cut = [], [], 0, 0
    for value, path, record in preference_records(files, reading):
        encoded = encoder.encode(value, f"{path}: record {record}")
        if isinstance(encoded, str):
            reading.bad(path, record, encoded)
            continue
        prompt, *answers = encoded
        if len(prompt) > seq_len:  # seq_len + 1 tokens a row: the prompt and at least one answer token
            reading.bad(path, record, f"the prompt's {len(prompt)} tokens leave no room for an answer in train.seq_len={seq_len}")
            continue
        if any(len(a) == 0 for a in answers):
            reading.bad(path, record, "an answer renders to no tokens")
            continue
        records += 1
        for answer in answers:
            room = seq_len + 1 - len(prompt)
            cut += len(answer) > room
            sequences.append(np.concatenate([prompt, answer[:room]]))
            prompt_lengths.append(len(prompt))
    if reading.skipped:
        log.warning(reading.summary())
    if not records:
        raise JaxdistError(f"preference:{files[0] if len(files) == 1 else f'{len(files)} files'}: no pair to train on")
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
    tokens = np.concatenate(sequences).astype(np.int32)
    log.info(
        f"preference: {records} pairs ({cut} answer(s) cut to train.seq_len={seq_len}), "
        f"{np.mean([len(s) for s in sequences]) / seq_len:.0%} of each row's tokens used"
    )
    pairs = PreferencePairs(tokens, offsets, np.asarray(prompt_lengths, np.int64), seq_len, document_mask)
    return pairs, int(tokens.max())
