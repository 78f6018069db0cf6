"""``data.source=chat``: supervised fine-tuning on conversations.

Each record of ``data.path`` (JSON Lines ``{"messages": [{"role": ..., "content": ...}, ...]}``,
``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, or a Parquet file with a ``messages`` column; local
paths, globs, folders or URLs as every corpus takes them) is rendered with the chat template
(``jaxdist.data.chat_template``), tokenised, and given its loss mask: with
``data.loss_on=assistant`` a target counts when its token holds a character of the assistant's
text (its messages and the end-of-turn text the template closes them with); with ``all``
every target of the conversation counts.

A conversation longer than ``train.seq_len`` is cut to its first seq_len + 1 tokens or left
out (``data.chat_overflow``); one with no target in the loss (no assistant message, or none
left after the cut) is left out; the log line counts each. The last ``data.eval_fraction``
of the conversations (in file order) are held out. Each split is packed into rows of
``train.seq_len``: whole conversations, longest first, each into the row it fills best
(best-fit decreasing), every conversation its own segment (positions restart, attention stays
inside it), the rest of a row padding that carries no loss. The rows are a fixed,
random-access source, so the Grain pipeline shuffles them by seed, resumes and splits them
across processes as it does packed text.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
from collections.abc import Iterator

import numpy as np

from jaxdist.config import Config
from jaxdist.data.chat_template import ChatTemplate, check_messages, find_chat_template
from jaxdist.data.records import JSONL_SUFFIXES, PARQUET_SUFFIXES, RecordReading, jsonl_lines
from jaxdist.data.text import expand_inputs
from jaxdist.data.tokenizers import Tokenizer, load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import open_binary

log = logging.getLogger(__name__)
FIELD = "messages"


@dataclasses.dataclass
class Conversations:
    """Tokenised conversations back to back: conversation i is ``tokens[offsets[i]:offsets[i+1]]``;
    ``in_loss[j]`` says whether token j counts as a target (never a conversation's first)."""

    tokens: np.ndarray
    in_loss: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, indices: np.ndarray) -> Conversations:
        pieces = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in indices]
        flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        lengths = self.lengths()[indices]
        return Conversations(self.tokens[flat], self.in_loss[flat], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def conversation_records(files, reading: RecordReading) -> Iterator[tuple[list[dict], str]]:
    """(messages, "FILE: record N") of every record; a bad one goes to ``reading`` (stop or skip)."""
    for path in files:
        name = str(path).lower()
        if name.endswith(PARQUET_SUFFIXES):
            yield from _parquet_records(path, reading)
        elif name.endswith(JSONL_SUFFIXES):
            yield from _jsonl_records(path, reading)
        else:
            raise JaxdistError(f"{path}: data.source=chat reads JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files")


def _jsonl_records(path, reading: RecordReading) -> Iterator[tuple[list[dict], str]]:
    try:
        for record, line in jsonl_lines(path, reading):
            messages = _messages_of_line(line)
            why = messages if isinstance(messages, str) else check_messages(messages)
            if why:
                reading.bad(path, record, why)
            else:
                yield messages, f"{path}: record {record}"
    except OSError as e:
        raise JaxdistError(f"cannot read input file {path}: {e.strerror or e}") from None


def _messages_of_line(line: bytes) -> list | str:
    """The record's messages, or why there are none."""
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte {e.start})"
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    if not isinstance(value, dict) or FIELD not in value:
        return f"no field '{FIELD}'"
    return value[FIELD]


def _parquet_records(path, reading: RecordReading) -> Iterator[tuple[list[dict], str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise JaxdistError(f"{path}: reading Parquet needs the pyarrow package (pip install 'jaxdist[storage]')") from None
    with open_binary(path) as source:
        try:
            parquet = pq.ParquetFile(source)
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
            raise JaxdistError(f"{path}: not a readable Parquet file ({e})") from None
        if FIELD not in parquet.schema_arrow.names:
            raise JaxdistError(f"{path}: no column '{FIELD}' (columns: {', '.join(parquet.schema_arrow.names[:8])})")
        record = 0
        for group in range(parquet.num_row_groups):
            for messages in parquet.read_row_group(group, columns=[FIELD]).column(0).to_pylist():
                record += 1
                if isinstance(messages, list):  # a struct column fills fields a message lacks with None
                    messages = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages if isinstance(m, dict)]
                why = check_messages(messages)
                if why:
                    reading.bad(path, record, why)
                else:
                    yield messages, f"{path}: record {record}"


def tokens_in_loss(text: str, spans: list[tuple[int, int]], offsets: np.ndarray) -> np.ndarray:
    """Which tokens hold a character of ``spans`` (bool per token; ``offsets`` [n, 2]: each
    token's [start, end) characters). An empty-span token counts when it starts inside one."""
    depth = np.zeros(len(text) + 1, np.int64)
    for start, end in spans:
        depth[start] += 1
        depth[end] -= 1
    inside = np.cumsum(depth)[: len(text)] > 0
    covered = np.concatenate([[0], np.cumsum(inside)])
    starts, ends = np.clip(offsets[:, 0], 0, len(text)), np.clip(offsets[:, 1], 0, len(text))
    held = covered[ends] - covered[starts] > 0
    empty_inside = (ends <= starts) & np.append(inside, False)[starts]
    return held | empty_inside


def encode_conversation(messages: list[dict], template: ChatTemplate, tokenizer: Tokenizer, loss_on: str, where: str = ""):
    """(token ids, whether each token is in the loss) of one conversation."""
    if loss_on == "all":
        ids = np.asarray(tokenizer.encode(template.render(messages, where=where)), np.int32)
        return ids, np.ones(len(ids), bool)
    text, spans = template.assistant_spans(messages, where)
    ids, offsets = tokenizer.encode_with_offsets(text)
    return np.asarray(ids, np.int32), tokens_in_loss(text, spans, offsets)


@dataclasses.dataclass
class Counts:
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    no_loss: int = 0  # no target in the loss (after the cut)


def encode_all(records, template: ChatTemplate, tokenizer: Tokenizer, loss_on: str, seq_len: int, overflow: str):
    """(Conversations, Counts): every conversation that fits (or is cut to) seq_len + 1 tokens
    and has a target in the loss."""
    tokens, flags, lengths, counts = [], [], [], Counts()
    for messages, where in records:
        counts.conversations += 1
        ids, in_loss = encode_conversation(messages, template, tokenizer, loss_on, where)
        if len(ids) > seq_len + 1:
            if overflow == "drop":
                counts.dropped += 1
                continue
            counts.truncated += 1
            ids, in_loss = ids[: seq_len + 1], in_loss[: seq_len + 1]
        in_loss = in_loss.copy()
        in_loss[:1] = False  # the first token is never a target
        if not in_loss.any():
            counts.no_loss += 1
            continue
        tokens.append(ids)
        flags.append(in_loss)
        lengths.append(len(ids))
    if not tokens:
        return Conversations(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(1, np.int64)), counts
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Conversations(np.concatenate(tokens), np.concatenate(flags), offsets), counts


def pack_rows(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Conversations (their target counts) into rows of ``seq_len``: longest first, each into
    the row with the least room that holds it (best-fit decreasing; ties: the older row)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free slots, row), sorted
    for i in np.argsort(-lengths, kind="stable"):
        need = int(lengths[i])
        k = bisect.bisect_left(room, (need, -1))
        if k < len(room):
            free, row = room.pop(k)
            rows[row].append(int(i))
        else:
            free, row = seq_len, len(rows)
            rows.append([int(i)])
        if free - need > 0:
            bisect.insort(room, (free - need, row))
    return [sorted(r) for r in rows]


class ChatExamples:
    """Packed conversations as a random-access source (pickles as its arrays, for Grain's workers)."""

    def __init__(self, conversations: Conversations, seq_len: int, document_mask: bool):
        self.conversations, self.seq_len, self.document_mask = conversations, seq_len, document_mask
        rows = pack_rows(conversations.lengths() - 1, seq_len)
        self.members = np.asarray([c for row in rows for c in row], np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        c, seq = self.conversations, self.seq_len
        inputs, targets = np.zeros(seq, np.int32), np.zeros(seq, np.int32)
        loss_mask, segment_ids, positions = np.zeros(seq, np.float32), np.zeros(seq, np.int32), np.zeros(seq, np.int32)
        at, members = 0, self.members[self.row_offsets[index] : self.row_offsets[index + 1]]
        for segment, member in enumerate(members):
            lo, hi = c.offsets[member], c.offsets[member + 1]
            n = hi - lo - 1
            inputs[at : at + n], targets[at : at + n] = c.tokens[lo : hi - 1], c.tokens[lo + 1 : hi]
            loss_mask[at : at + n] = c.in_loss[lo + 1 : hi]
            segment_ids[at : at + n], positions[at : at + n] = segment, np.arange(n)
            at += n
        segment_ids[at:], positions[at:] = len(members), np.arange(seq - at)  # padding: a segment of its own, no loss
        example = {"inputs": inputs, "targets": targets, "loss_mask": loss_mask}
        if self.document_mask:
            example |= {"segment_ids": segment_ids, "positions": positions}
        return example

    def filled(self) -> tuple[int, int]:
        """(target slots that hold a token, slots in the loss)."""
        return int(np.sum(self.conversations.lengths() - 1)), int(np.sum(self.conversations.in_loss))


def chat_splits(config: Config) -> tuple[ChatExamples, ChatExamples]:
    """The train and eval examples of ``data.source=chat``."""
    d, t = config.data, config.train
    if not d.path:
        raise JaxdistError('data.source=chat needs data.path (JSON Lines of {"messages": [...]}: files, globs or a directory)')
    train, evaluation, max_id = _splits(
        tuple(str(f) for f in expand_inputs(d.path)),
        "" if d.tokenizer == "byte" else d.tokenizer,
        d.chat_template,
        d.loss_on,
        d.bad_records,
        t.seq_len,
        d.chat_overflow,
        d.eval_fraction,
        d.document_mask,
    )
    m = config.model
    if max_id >= (m.valid_vocab or m.vocab_size):
        raise JaxdistError(f"token id {max_id} in chat:{d.path} >= the model's vocab ({m.valid_vocab or m.vocab_size})")
    return train, evaluation


@functools.cache  # train and eval, and every iterator of a process, share one tokenisation
def _splits(files, tokenizer_path, template_file, loss_on, bad_records, seq_len, overflow, eval_fraction, document_mask):
    tokenizer = load_tokenizer(tokenizer_path or None)
    template = find_chat_template(template_file, tokenizer_path)
    reading = RecordReading(FIELD, bad_records)
    conversations, counts = encode_all(conversation_records(files, reading), template, tokenizer, loss_on, seq_len, overflow)
    if reading.skipped:
        log.warning(reading.summary())
    kept = len(conversations)
    if kept < 2:
        raise JaxdistError(
            f"chat:{files[0] if len(files) == 1 else f'{len(files)} files'}: {kept} conversation(s) to train on "
            f"({_counted(counts, seq_len, overflow, loss_on)}); need two: one to train, one to evaluate"
        )
    n_eval = min(max(1, round(kept * eval_fraction)), kept - 1)
    train = ChatExamples(conversations.take(np.arange(kept - n_eval)), seq_len, document_mask)
    evaluation = ChatExamples(conversations.take(np.arange(kept - n_eval, kept)), seq_len, document_mask)
    slots, in_loss = train.filled()
    log.info(
        f"chat: {counts.conversations} conversations ({_counted(counts, seq_len, overflow, loss_on)}) with {template.source}; "
        f"{len(train)} training rows of {seq_len} ({slots / (len(train) * seq_len):.0%} tokens, {in_loss / (len(train) * seq_len):.0%} "
        f"in the loss), {len(evaluation)} held-out rows ({n_eval} conversations)"
    )
    return train, evaluation, int(conversations.tokens.max())


def _counted(counts: Counts, seq_len: int, overflow: str, loss_on: str) -> str:
    longer = (
        f"{counts.truncated} cut to train.seq_len={seq_len}"
        if overflow == "truncate"
        else f"{counts.dropped} longer than train.seq_len={seq_len} dropped"
    )
    nothing = "no assistant token" if loss_on == "assistant" else "under two tokens"
    return f"{longer}, {counts.no_loss} left out with {nothing}{' after the cut' if overflow == 'truncate' else ''}"
