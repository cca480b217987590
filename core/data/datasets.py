"""Datasets and the stateful token-window loader.

Datasets (`DATASETS`), each an ordered, resumable stream of document texts:
  "c4"          allenai/c4 "en", streamed with `datasets.load_dataset` (the paper's data);
                the hub's reachability is checked first (seconds, not minutes).
  "c4_offline"  the same `datasets` code path over local shards in C4's layout
                (`<path>/en/c4-{split}.*.json.gz`, built by `python -m core.data.assets --corpus`).
  "synthetic"   deterministic, learnable documents generated in code (for tests; no files).

`TokenWindowLoader` tokenizes documents (BOS + text + EOS), concatenates them into one global
token stream, cuts it into windows of `seq_len + 1` tokens, and gives each data-parallel rank
its slice of every global batch as `(inputs[B, S], labels[B, S])` int64 tensors.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import torch

from core.data.sharding import SHARDINGS, check_resume_state, data_sharding, sharding_state, split_by_rank
from core.data.store import c4_offline_path
from core.data.synthetic import SyntheticDocuments, synthetic_document
from core.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "BadDocumentError",
    "DatasetSpec",
    "DatasetUnavailableError",
    "DocumentSource",
    "HFDocuments",
    "JsonLinesDocuments",
    "SyntheticDocuments",
    "TokenWindowLoader",
    "build_dataloader",
    "build_tokenizer",
    "check_hub_reachable",
    "data_sharding",
    "find_bad_line",
    "open_documents",
    "synthetic_document",
]

logger = logging.getLogger(__name__)

C4_REPO = "allenai/c4"
HUB_DEFAULT_ENDPOINT = "https://huggingface.co"
HUB_CONNECT_TIMEOUT_S = 3.0
_CORPUS_SETUP = "python -m core.data.assets --corpus"
_OFFLINE_HINT = f'set `data.dataset = "c4_offline"` (after `{_CORPUS_SETUP}`)'


class DatasetUnavailableError(RuntimeError):
    """A dataset cannot be read here; the message says what to use or run instead."""


# --------------------------------------------------------------------------------------------
# document sources
# --------------------------------------------------------------------------------------------
class DocumentSource(Protocol):
    """An ordered stream of document texts that can be restarted and resumed."""

    def open(self, position: dict | None) -> None:
        """Start iterating: from the beginning if `position` is None, else from a position()."""

    def next_text(self) -> str:
        """The next document's text; StopIteration at the end of the data."""

    def position(self) -> dict:
        """Where the stream stands, right after the last document returned."""


class BadDocumentError(ValueError):
    """A malformed corpus line; the message names the file and the line."""


def _parse_line(raw: bytes, text_field: str) -> str:
    doc = json.loads(raw)
    if not isinstance(doc, dict) or not isinstance(doc.get(text_field), str):
        raise TypeError(f"not a JSON object with a string {text_field!r}")
    return doc[text_field]


def find_bad_line(files: list[str], text_field: str = "text") -> str | None:
    """'file:line: what' of the first malformed line of JSON-lines (gzip) files, or None."""
    for name in files:
        try:
            with gzip.open(name, "rb") as f:
                for n, raw in enumerate(f, 1):
                    try:
                        _parse_line(raw, text_field)
                    except (ValueError, TypeError) as e:
                        return f"{name}:{n}: malformed document ({e})"
        except (OSError, EOFError) as e:
            return f"{name}: unreadable ({type(e).__name__}: {e})"
    return None


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
                    self._f.readline()
            raw = self._f.readline()
            if not raw:
                self._f.close()
                self._f, self._file, self._line = None, self._file + 1, 0
                continue
            self._line += 1
            try:
                return _parse_line(raw, self.text_field)
            except (ValueError, TypeError) as e:
                where = f"{self.files[self._file]}:{self._line}"
                if where not in self.bad:
                    self.bad.append(where)
                    logger.warning("%s: malformed document skipped (%s)", where, e)

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


# --------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def check_hub_reachable(timeout: float = HUB_CONNECT_TIMEOUT_S) -> None:
    """Raise DatasetUnavailableError within about `timeout` seconds unless a TCP connection to
    the hub (or to the HTTPS proxy in use) can be opened. HF_HUB_OFFLINE=1 fails at once."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if _truthy(os.environ.get(var)):
            raise DatasetUnavailableError(
                f"{var}=1 is set, so dataset 'c4' ({C4_REPO} 'en', streamed from the hub) cannot be "
                f"read. For the offline corpus in C4's layout, {_OFFLINE_HINT}."
            )
    endpoint = os.environ.get("HF_ENDPOINT") or HUB_DEFAULT_ENDPOINT
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlparse(proxy if proxy else endpoint)
    host = target.hostname or "huggingface.co"
    port = target.port or (443 if target.scheme in ("https", "") else 80)
    outcome: dict[str, Any] = {}

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome["ok"] = True
        except OSError as e:
            outcome["error"] = e

    # a thread bounds the DNS lookup too, which socket timeouts do not cover
    thread = threading.Thread(target=probe, name="hub-reachability", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if not outcome.get("ok"):
        why = outcome.get("error") or f"no answer within {timeout:.0f} s"
        via = f" via proxy {host}:{port}" if proxy else f" ({host}:{port})"
        raise DatasetUnavailableError(
            f"The Hugging Face hub is not reachable{via}: {why}. Dataset 'c4' ({C4_REPO} 'en') is "
            f"streamed from it. For the offline corpus in C4's layout, {_OFFLINE_HINT}."
        )


def _open_c4(path: str | None, split: str, rank: int = 0, world: int = 1) -> DocumentSource:
    check_hub_reachable()
    from datasets import load_dataset  # local: HF datasets costs seconds to import; synthetic runs skip it

    ds = load_dataset(path or C4_REPO, name="en", split=split, streaming=True)
    return HFDocuments(split_by_rank(ds, rank, world))


def _c4_offline_files(path: str | None, split: str) -> list[str]:
    root = Path(path) if path else c4_offline_path()
    en = root / "en" if (root / "en").is_dir() else root
    files = sorted(en.glob(f"c4-{split}.*.json.gz"))
    if not files:
        what = "does not exist" if not en.exists() else f"has no c4-{split}.*.json.gz shards"
        raise FileNotFoundError(
            f"Offline C4-layout corpus not found: {en} {what}. Dataset 'c4_offline' reads shards built "
            f"by `{_CORPUS_SETUP}` (into assets/c4_offline/en/); run it, or point data.dataset_path "
            f"at a folder holding c4-{split}.*.json.gz files."
        )
    return [str(f) for f in files]


def _open_c4_offline(path: str | None, split: str, rank: int = 0, world: int = 1) -> DocumentSource:
    files = _c4_offline_files(path, split)
    from datasets import load_dataset  # local: import cost, as above

    ds = load_dataset("json", data_files=files, split="train", streaming=True)
    return HFDocuments(split_by_rank(ds, rank, world), files=files)


def _open_synthetic(path: str | None, split: str, rank: int = 0, world: int = 1) -> DocumentSource:
    return SyntheticDocuments(split, rank=rank, world=world)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    description: str
    # (path or None, split, rank, world) -> source; rank/world: this DP rank's documents only
    open: Callable[..., DocumentSource]


DATASETS: dict[str, DatasetSpec] = {
    "c4": DatasetSpec("c4", f"{C4_REPO} 'en', streamed from the Hugging Face hub (the paper's data)", _open_c4),
    "c4_offline": DatasetSpec(
        "c4_offline", f"local json.gz shards in C4's layout (built by `{_CORPUS_SETUP}`)", _open_c4_offline
    ),
    "synthetic": DatasetSpec("synthetic", "deterministic learnable documents made in code (tests)", _open_synthetic),
}


def open_documents(
    dataset: str, path: str | None = None, split: str = "train", rank: int = 0, world: int = 1
) -> DocumentSource:
    """The documents of a dataset; with world > 1 only rank's part of them (per-rank sharding)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {sorted(DATASETS)}")
    if world == 1:
        return DATASETS[dataset].open(path, split)
    return DATASETS[dataset].open(path, split, rank, world)


# --------------------------------------------------------------------------------------------
# the loader
# --------------------------------------------------------------------------------------------
class TokenWindowLoader:
    """Per-rank batches of packed token windows, resumable on the exact next token.

    Args:
        dataset: a key of DATASETS ("c4", "c4_offline", "synthetic").
        path: dataset location override (hub repo id for "c4", corpus folder for "c4_offline").
        tokenizer: a Tokenizer (or a path / short name for `build_tokenizer`); None only for
            "synthetic", which then uses ByteTokenizer.
        seq_len: tokens per sample S; windows hold S + 1 tokens (inputs w[:-1], labels w[1:]).
        local_batch_size: samples per rank per step B.
        dp_rank, dp_degree: this rank's place in the data-parallel dimension.
        split: "train" or "validation".
        infinite: start the corpus again when it ends (else stop, dropping a partial batch).
        sharding: "global" (every rank reads the whole stream, keeps its slice) or "per_rank"
            (each DP rank reads only its own documents): see core.data.sharding.

    Yields `(inputs, labels)`, both int64 `[B, S]`.
    """

    def __init__(
        self,
        dataset: str,
        path: str | None = None,
        tokenizer: Tokenizer | ByteTokenizer | str | None = None,
        seq_len: int = 2048,
        local_batch_size: int = 1,
        dp_rank: int = 0,
        dp_degree: int = 1,
        split: str = "train",
        infinite: bool = True,
        sharding: str = "global",
    ):
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len and local_batch_size must be >= 1, got {seq_len}, {local_batch_size}")
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, dp_degree), got dp_rank={dp_rank}, dp_degree={dp_degree}")
        if tokenizer is None:
            if dataset != "synthetic":
                raise ValueError(f"dataset {dataset!r} needs a tokenizer")
            tokenizer = ByteTokenizer()
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = build_tokenizer(tokenizer)
        self.dataset = dataset
        self.path = path
        self.split = split
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.infinite = infinite
        self.sharding = sharding
        per_rank = sharding == "per_rank"
        # errors surface here, at once
        self._source = open_documents(dataset, path, split, dp_rank if per_rank else 0, dp_degree if per_rank else 1)
        self._opened = False
        self._resume: dict | None = None
        self._epoch = 0
        self._docs_in_epoch = 0  # documents taken from the source in this pass
        self._buffer: list[int] = []  # tokenized but not yet batched (the global stream's next tokens)
        self._batches = 0

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> TokenWindowLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank reads the whole global stream and keeps its own B windows of each global
        # batch of dp_degree * B consecutive windows, so the global batch (and its token order)
        # is the same for any DP degree: exact loss parity across layouts.
        window = self.seq_len + 1
        per_rank = self.sharding == "per_rank"  # the buffer holds this rank's own stream only
        global_tokens = (1 if per_rank else self.dp_degree) * self.local_batch_size * window
        while len(self._buffer) < global_tokens:
            self._buffer.extend(self.tokenizer.encode(self._next_document(), bos=True, eos=True))
        lo = 0 if per_rank else self.dp_rank * self.local_batch_size * window
        mine = torch.tensor(self._buffer[lo : lo + self.local_batch_size * window], dtype=torch.int64)
        del self._buffer[:global_tokens]
        self._batches += 1
        mine = mine.view(self.local_batch_size, window)
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def _next_document(self) -> str:
        if not self._opened:
            self._source.open(self._resume)
            self._opened = True
        try:
            text = self._source.next_text()
        except StopIteration:
            if not self.infinite:
                raise
            if self._docs_in_epoch == 0:
                raise RuntimeError(f"dataset {self.dataset!r} ({self.split}) yields no documents") from None
            logger.warning(
                "dataset %r (%s) ended after %d documents (pass %d); starting it again",
                self.dataset,
                self.split,
                self._docs_in_epoch,
                self._epoch,
            )
            self._epoch += 1
            self._docs_in_epoch = 0
            self._source.open(None)
            text = self._source.next_text()
        self._docs_in_epoch += 1
        return text

    # -- state ----------------------------------------------------------------------------------
    @property
    def bad_documents(self) -> list[str]:
        """'file:line' of the malformed lines skipped so far (data.skip_bad_documents)."""
        return list(getattr(self._source, "bad", []))

    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        """The position in the global token stream. It is the same on every rank (each reads
        the whole stream), so one copy serves any rank and any DP degree on resume. Per-rank
        sharding: this rank's own position, for the same rank of the same DP degree."""
        position = self._source.position() if self._opened else self._resume
        return {
            **sharding_state(self.sharding, self.dp_rank, self.dp_degree),
            "dataset": self.dataset,
            "split": self.split,
            "epoch": self._epoch,
            "docs_in_epoch": self._docs_in_epoch,
            "source_position": position,
            "token_buffer": list(self._buffer),
            "batches": self._batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset") != self.dataset or state.get("split") != self.split:
            raise ValueError(
                f"loader state is for dataset {state.get('dataset')!r} split {state.get('split')!r}, "
                f"not {self.dataset!r} split {self.split!r}"
            )
        check_resume_state(state, self.sharding, self.dp_rank, self.dp_degree)
        self._epoch = int(state["epoch"])
        self._docs_in_epoch = int(state["docs_in_epoch"])
        self._resume = state["source_position"]
        self._buffer = [int(t) for t in state["token_buffer"]]
        self._batches = int(state.get("batches", 0))
        self._opened = False  # the source reopens at the saved position on the next batch


def build_dataloader(
    cfg: Any,
    tokenizer: Tokenizer | ByteTokenizer | None,
    dp_rank: int,
    dp_degree: int,
    vocab_size: int | None = None,
    split: str = "train",
    local_batch_size: int | None = None,
) -> TokenWindowLoader:
    """The loader a job config asks for (`data.dataset`, `data.path` (c4_offline), `data.sharding`,
    `training.seq_len`, `training.local_batch_size`, `training.dataset_infinite`); checks the ids
    fit the model."""
    data, training = cfg.data, cfg.training
    dataset = data.dataset
    # data.path is the local corpus of "c4_offline"; "c4" always streams allenai/c4 from the hub
    path = (getattr(data, "path", None) or None) if dataset == "c4_offline" else None
    loader = TokenWindowLoader(
        dataset,
        path=path,
        tokenizer=tokenizer,
        seq_len=training.seq_len,
        local_batch_size=local_batch_size or training.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        split=split,
        infinite=getattr(training, "dataset_infinite", True),
        sharding=data_sharding(cfg),
    )
    if dataset == "c4_offline" and getattr(data, "skip_bad_documents", False):
        files = _c4_offline_files(path, split)
        if loader.sharding == "per_rank" and dp_degree > 1:  # this rank's shards only
            if len(files) % dp_degree:
                raise ValueError(
                    f"data.skip_bad_documents with per-rank sharding needs the {len(files)} shards "
                    f"to divide by the DP degree {dp_degree} (or data.sharding = 'global')"
                )
            files = files[dp_rank::dp_degree]
        loader._source = JsonLinesDocuments(files)  # same order, skips bad lines
    if vocab_size is not None and loader.tokenizer.n_words > vocab_size:
        raise ValueError(f"the tokenizer has {loader.tokenizer.n_words} ids but the model's vocabulary is {vocab_size}")
    return loader
