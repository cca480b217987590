"""Where a loader's documents come from: the DocumentSource protocol, a Hugging Face streaming
dataset (C4 from the hub, or local shards through the same JSON reader), and a plain reader of
local JSON-lines shards that skips what it cannot read (data.skip_bad_documents). A malformed
line or a broken gzip stream is named by file and line.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from typing import Any, Protocol

from core.data.shards import CorpusError

logger = logging.getLogger(__name__)


class DocumentSource(Protocol):
    """An ordered stream of document texts that can be restarted and resumed."""

    def open(self, position: dict | None) -> None:
        """Start iterating: from the beginning if `position` is None, else from a position()."""

    def next_text(self) -> str:
        """The next document's text; StopIteration at the end of the data."""

    def position(self) -> dict:
        """Where the stream stands, right after the last document returned."""


class BadDocumentError(CorpusError):
    """A malformed corpus line; the message names the file and the line."""


def _parse_line(raw: bytes, text_field: str) -> str:
    doc = json.loads(raw)
    if not isinstance(doc, dict) or not isinstance(doc.get(text_field), str):
        raise TypeError(f"not a JSON object with a string {text_field!r}")
    return doc[text_field]


def find_bad_line(files: list[str], text_field: str = "text") -> str | None:
    """'file:line: what' of the first malformed line of JSON-lines (gzip) files, or None."""
    for name in files:
        n = 0
        try:
            with gzip.open(name, "rb") as f:
                for n, raw in enumerate(f, 1):
                    try:
                        _parse_line(raw, text_field)
                    except (ValueError, TypeError) as e:
                        return f"{name}:{n}: malformed document ({e})"
        except (OSError, EOFError, zlib.error) as e:
            return f"{name}:{n + 1}: {_stream_error(e)}"
    return None


def _stream_error(e: BaseException) -> str:
    """What a gzip reader's error means, in words."""
    if isinstance(e, EOFError):
        return "the gzip stream ends early (a truncated shard)"
    return f"unreadable gzip data ({type(e).__name__}: {e})"


class JsonLinesDocuments:
    """The documents of local JSON-lines shards (gzip), in file then line order (the order the
    `datasets` JSON reader gives), skipping malformed lines and keeping their 'file:line'.
    Used when data.skip_bad_documents is on. Position: {"file": index, "line": lines read}."""

    def __init__(self, files: list[str], text_field: str = "text"):
        self.files, self.text_field = files, text_field
        self.bad: list[str] = []  # 'file:line' of the skipped lines
        self._file, self._line, self._f = 0, 0, None

    def open(self, position: dict | None) -> None:
        if self._f is not None:
            self._f.close()
        self._file, self._line = (position["file"], position["line"]) if position else (0, 0)
        self._f = None

    def next_text(self) -> str:
        while True:
            if self._f is None:
                if self._file >= len(self.files):
                    raise StopIteration
                self._f = gzip.open(self.files[self._file], "rb")  # noqa: SIM115 - kept open across calls
                for _ in range(self._line):
                    if self._readline() is None:
                        break
            if self._f is None:  # the shard broke off before the resume point
                continue
            raw = self._readline()
            if raw is None:  # a broken shard: the rest skipped, the next one opened
                continue
            if not raw:  # the end of the shard
                self._next_file()
                continue
            self._line += 1
            try:
                return _parse_line(raw, self.text_field)
            except (ValueError, TypeError) as e:
                self._skip(f"{self.files[self._file]}:{self._line}", f"malformed document skipped ({e})")

    def _readline(self) -> bytes | None:
        """The next raw line; None where the gzip stream breaks (its rest is skipped and counted)."""
        try:
            return self._f.readline()
        except (OSError, EOFError, zlib.error) as e:
            self._skip(
                f"{self.files[self._file]}:{self._line + 1}", f"{_stream_error(e)}: the rest of the shard skipped"
            )
            self._next_file()
            return None

    def _next_file(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f, self._file, self._line = None, self._file + 1, 0

    def _skip(self, where: str, what: str) -> None:
        if where not in self.bad:
            self.bad.append(where)
            logger.warning("%s: %s", where, what)

    def position(self) -> dict:
        return {"file": self._file, "line": self._line}


class HFDocuments:
    """Documents of a Hugging Face streaming `IterableDataset`.

    Resume uses the dataset's own `state_dict()` (shard index + offset), so a resumed C4 run
    does not re-read the shards it has already consumed. `files`: the local shards it reads, if
    any; a read error is then reported as the malformed line that caused it.
    """

    def __init__(self, dataset: Any, text_field: str = "text", files: list[str] | None = None):
        self.dataset = dataset
        self.text_field = text_field
        self.files = files
        # `load_state_dict` is applied again at every `iter()`, so every epoch starts from an
        # explicit state: this one for "from the beginning".
        self._start = dataset.state_dict()
        self._it: Iterator[dict] | None = None

    def open(self, position: dict | None) -> None:
        self.dataset.load_state_dict(position if position is not None else self._start)
        self._it = iter(self.dataset)

    def next_text(self) -> str:
        assert self._it is not None, "open() first"
        try:
            text = next(self._it).get(self.text_field)
            if not isinstance(text, str):  # a line without the field: the merged schema gives None
                raise TypeError(f"no string {self.text_field!r}")
            return text
        except StopIteration:
            raise
        except Exception as e:  # pyarrow / datasets errors name no line
            where = find_bad_line(self.files, self.text_field) if self.files else None
            if where is None:
                raise
            raise BadDocumentError(
                f"{where}; fix or remove it, or set data.skip_bad_documents=true (the reader said {type(e).__name__})"
            ) from None

    def position(self) -> dict:
        return copy.deepcopy(self.dataset.state_dict() if self._it is not None else self._start)
