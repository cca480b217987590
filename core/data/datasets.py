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

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from core.data.documents import BadDocumentError, DocumentSource, HFDocuments, JsonLinesDocuments, find_bad_line
from core.data.sharding import SHARDINGS, check_resume_state, data_sharding, own_files, sharding_state, split_by_rank
from core.data.shards import CORPUS_SETUP, CorpusError, c4_shards
from core.data.synthetic import SyntheticDocuments, synthetic_document
from core.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "DatasetUnavailableError",
    "SyntheticDocuments",
    "TokenWindowLoader",
    "build_dataloader",
    "build_tokenizer",
    "check_hub_reachable",
    "data_sharding",
    "open_documents",
    "synthetic_document",
]

logger = logging.getLogger(__name__)

C4_REPO = "allenai/c4"
HUB_DEFAULT_ENDPOINT = "https://huggingface.co"
HUB_CONNECT_TIMEOUT_S = 3.0
_OFFLINE_HINT = f'set `data.dataset = "c4_offline"` (after `{CORPUS_SETUP}`)'


class DatasetUnavailableError(RuntimeError):
    """A dataset cannot be read here; the message says what to use or run instead."""


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
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node: 512 ranks probing the hub is a burst of its own
        check_hub_reachable()
    from datasets import load_dataset  # local: HF datasets costs seconds to import; synthetic runs skip it

    ds = load_dataset(path or C4_REPO, name="en", split=split, streaming=True)
    return HFDocuments(split_by_rank(ds, rank, world))


def _c4_offline_files(path: str | None, split: str) -> list[str]:
    return [str(f) for f in c4_shards(path, split)]


def _open_c4_offline(path: str | None, split: str, rank: int = 0, world: int = 1) -> DocumentSource:
    files = _c4_offline_files(path, split)
    from datasets import load_dataset  # local: import cost, as above

    try:  # the JSON reader opens the first shard for its columns here: a bad one must be named
        ds = load_dataset("json", data_files=files, split="train", streaming=True)
        # a bad line is looked for in this rank's own shards only (C4 has 1,024 of them)
        return HFDocuments(split_by_rank(ds, rank, world), files=own_files(files, rank, world))
    except Exception as e:  # noqa: BLE001 - pyarrow / datasets raise many kinds; the file is named below
        where = find_bad_line(files)
        if where is None:
            raise CorpusError(f"data.path: {files[0]} ...: the JSON reader failed ({type(e).__name__}: {e})") from None
        raise BadDocumentError(f"{where}; fix or remove it, or set data.skip_bad_documents=true") from None


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
        "c4_offline", f"local json.gz shards in C4's layout (built by `{CORPUS_SETUP}`)", _open_c4_offline
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
        source: DocumentSource | None = None,
    ):
        """`source`: the documents to read, when not the dataset's own reader (skip_bad_documents)."""
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
        self._source = source or open_documents(
            dataset, path, split, dp_rank if per_rank else 0, dp_degree if per_rank else 1
        )
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
    sharding = data_sharding(cfg)
    source = None
    if dataset == "c4_offline" and getattr(data, "skip_bad_documents", False):
        files = _c4_offline_files(path, split)
        if sharding == "per_rank" and dp_degree > 1:  # this rank's shards only
            if len(files) % dp_degree:
                raise ValueError(
                    f"data.skip_bad_documents with per-rank sharding needs the {len(files)} shards "
                    f"to divide by the DP degree {dp_degree} (or data.sharding = 'global')"
                )
            files = files[dp_rank::dp_degree]
        source = JsonLinesDocuments(files)  # the JSON reader's order, skipping what it cannot read
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
        sharding=sharding,
        source=source,
    )
    if vocab_size is not None and loader.tokenizer.n_words > vocab_size:
        raise ValueError(f"the tokenizer has {loader.tokenizer.n_words} ids but the model's vocabulary is {vocab_size}")
    return loader
