"""Tokenized text kept on disk (``jaxdist.data.token_cache``): a later process maps the tokens an
earlier one encoded, an edited file is encoded again, and a damaged entry or a folder that
cannot be written costs an encode and one line, never a wrong token."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.data import sources, token_cache

EOD = 256  # the byte tokenizer's end of document


def _open(files, **how):
    """The corpus as a new process would open it (the per-process memo bypassed)."""
    return sources._text_corpus.__wrapped__("text", tuple(files), "", how.get("unit", "file"), "text", how.get("bad_records", "stop"))


def _expected(*texts: str) -> list[int]:
    return [t for text in texts for t in [*text.encode(), EOD]]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokens"


def test_a_later_process_maps_the_tokens_and_an_edited_file_is_encoded_again(tmp_path, cache, monkeypatch):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("héllo"), b.write_text("world")
    first = _open([a, b])
    assert first.stream.tokens.tolist() == _expected("héllo", "world")
    (entry,) = cache.glob("*.npy")
    assert (cache.stat().st_mode & 0o777) == 0o700
    monkeypatch.setattr(sources, "_encode_documents", lambda *_: pytest.fail("encoded again"))
    again = _open([a, b])
    assert isinstance(again.stream.tokens, np.memmap) and again.stream.tokens.tolist() == _expected("héllo", "world")
    assert again.max_token_id == EOD
    monkeypatch.undo()
    monkeypatch.setenv("JAXDIST_CACHE", str(cache.parent))
    b.write_text("world, edited")
    assert _open([a, b]).stream.tokens.tolist() == _expected("héllo", "world, edited")
    assert _open([a, b], unit="line").stream.tokens.tolist() == _expected("héllo", "world, edited")  # another cut, another entry
    assert len(list(cache.glob("*.npy"))) == 3 and entry.exists()


def test_a_damaged_entry_is_said_and_encoded_again(tmp_path, cache, capsys):
    a = tmp_path / "a.txt"
    a.write_text("some text")
    _open([a])
    (entry,) = cache.glob("*.npy")
    entry.write_bytes(entry.read_bytes()[:-4])  # cut short
    capsys.readouterr()
    assert _open([a]).stream.tokens.tolist() == _expected("some text")
    said = [x for x in capsys.readouterr().err.splitlines() if "tokenized corpus cache" in x]
    assert len(said) == 1 and said[0].startswith(f"jaxdist: warning: tokenized corpus cache {entry} is unreadable ("), said
    assert np.load(entry).tolist() == _expected("some text")  # written anew


def test_a_folder_that_cannot_be_written_keeps_the_tokens_in_memory_and_says_so(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JAXDIST_CACHE", str(blocker))  # its tokens folder cannot be made
    a = tmp_path / "a.txt"
    a.write_text("text")
    token_cache._say_unwritable.cache_clear()
    assert _open([a]).stream.tokens.tolist() == _expected("text")
    assert _open([a]).stream.tokens.tolist() == _expected("text")
    said = [x for x in capsys.readouterr().err.splitlines() if "tokenized corpora" in x]
    assert said == [f"jaxdist: tokenized corpora are not kept in {blocker / 'tokens'} (Not a directory): each process encodes its corpus"]


def test_a_corpus_with_skipped_records_is_read_again_and_says_so_again(tmp_path, cache, capsys):
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "kept"}\nnot json\n')
    capsys.readouterr()
    for _ in range(2):
        assert _open([records], bad_records="skip").stream.tokens.tolist() == _expected("kept")
    assert sum("skipped" in x for x in capsys.readouterr().err.splitlines()) == 2
    assert not list(cache.glob("*.npy"))
