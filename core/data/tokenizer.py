"""Tokenizer: a tiktoken BPE with Llama 3's split pattern and special tokens.

The same class serves Meta's Llama 3 vocabulary (128,000 ranks) and the small proxy
vocabulary trained at set-up (4,096 ranks): both files are tiktoken-format
(`base64-token rank` per line) and get 256 special tokens appended after the base ranks,
named as Llama 3.1 names them. With Meta's file: BOS 128000, EOS 128001, eot 128009,
n_words 128256. With the proxy file: BOS 4096, EOS 4097, n_words 4352.

Neither file is committed: `python -m core.data.assets` derives them into `assets/`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Literal

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from core.data.store import file_sha256, llama3_tokenizer_path, proxy_tokenizer_path

__all__ = [
    "LLAMA3_PAT_STR",
    "LLAMA3_TOKENIZER_SHA256",
    "NUM_SPECIAL_TOKENS",
    "PROXY_TOKENIZER_SHA256",
    "ByteTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "file_sha256",
    "llama3_special_token_names",
]

# Llama 3's pre-tokenization regex (tiktoken's `pat_str`).
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# sha256 of Meta's Llama 3 / 3.1 `tokenizer.model` (128,000 base ranks).
LLAMA3_TOKENIZER_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"

# sha256 of the proxy vocabulary that `python -m core.data.assets --proxy-tokenizer` trains
# (rustbpe 0.1.0 on the offline corpus); golden losses of proxy runs were made with it.
PROXY_TOKENIZER_SHA256 = "9ded5a739083c11d6a3c3bc486c60f6ccac974670048add4a641850352297d16"

NUM_SPECIAL_TOKENS = 256

# tiktoken's Rust core can hit pathological run times (or stack depth) on huge inputs and
# on very long runs of whitespace / non-whitespace, so long strings are encoded in pieces,
# as Meta's reference tokenizer does.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUN_RE = re.compile(r"\s+|\S+")

_SETUP_HINT = {
    "llama3": "python -m core.data.assets --llama3-tokenizer",
    "proxy": "python -m core.data.assets --proxy-tokenizer",
}


def llama3_special_token_names(n: int = NUM_SPECIAL_TOKENS) -> list[str]:
    """Llama 3.1's special tokens in id order (offset from the first id after the base ranks)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(n - len(named))]
    return named + reserved


def _setup_command_for(path: Path) -> str:
    return _SETUP_HINT["proxy" if "proxy" in str(path) else "llama3"]


def _pieces(s: str) -> Iterator[str]:
    """Cut `s` into pieces tiktoken handles well; the cuts change nothing for normal text.

    First into blocks of at most _MAX_ENCODE_CHARS characters, then each block only inside a
    run of more than _MAX_RUN_CHARS consecutive whitespace (or non-whitespace) characters.
    """
    for start in range(0, len(s), _MAX_ENCODE_CHARS):
        block = s[start : start + _MAX_ENCODE_CHARS]
        if len(block) <= _MAX_RUN_CHARS:
            yield block
            continue
        cut = 0
        for m in _RUN_RE.finditer(block):
            a, b = m.span()
            if b - a <= _MAX_RUN_CHARS:
                continue
            for pos in range(a + _MAX_RUN_CHARS, b, _MAX_RUN_CHARS):
                yield block[cut:pos]
                cut = pos
        yield block[cut:]


class Tokenizer:
    """A tiktoken `Encoding` from a tiktoken-format BPE file plus Llama 3.1's special tokens.

    Args:
        path: the `tokenizer.model` file (`base64-token rank` lines).
        expected_sha256: if given, the file must have this sha256 (e.g. LLAMA3_TOKENIZER_SHA256).
    """

    def __init__(self, path: str | os.PathLike, expected_sha256: str | None = None):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"Tokenizer file not found: {path}. It is derived at set-up, never committed; "
                f"create it with `{_setup_command_for(path)}` (or `python -m core.data.assets --all`)."
            )
        sha = file_sha256(path)
        if expected_sha256 is not None and sha != expected_sha256.lower():
            raise ValueError(
                f"Tokenizer file {path} has sha256 {sha}, expected {expected_sha256}. "
                f"The file is corrupt or not the expected vocabulary; delete it and re-create it "
                f"with `{_setup_command_for(path)}`."
            )
        # tiktoken caches files by *path* in a temp dir; passing the content hash we just
        # computed makes it use the cache only if the cached copy equals this file.
        mergeable_ranks = load_tiktoken_bpe(str(path), expected_hash=sha)
        num_base = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(num_base)):
            raise ValueError(f"Tokenizer file {path}: ranks are not exactly 0..{num_base - 1}.")

        names = llama3_special_token_names()
        self.special_tokens: dict[str, int] = {name: num_base + i for i, name in enumerate(names)}
        self.path = str(path)
        self.sha256 = sha
        self.num_base_tokens = num_base
        self.model = tiktoken.Encoding(
            name=path.parent.name or path.stem,
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self._n_words = num_base + len(names)
        assert self.model.n_vocab == self._n_words, (self.model.n_vocab, self._n_words)
        self._bos_id = self.special_tokens["<|begin_of_text|>"]
        # The pre-training base model ends a document with end_of_text (not eot_id).
        self._eos_id = self.special_tokens["<|end_of_text|>"]
        self._eot_id = self.special_tokens["<|eot_id|>"]

    # -- ids --------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def eot_id(self) -> int:
        return self._eot_id

    @property
    def n_words(self) -> int:
        """Vocabulary size including the special tokens (the model's embedding rows)."""
        return self._n_words

    vocab_size = n_words

    # -- encode / decode --------------------------------------------------------------------
    def encode(
        self,
        s: str,
        bos: bool = False,
        eos: bool = False,
        allowed_special: Literal["all"] | AbstractSet[str] = frozenset(),
        disallowed_special: Literal["all"] | Collection[str] = (),
    ) -> list[int]:
        """Token ids of `s`, with BOS first / EOS last if asked.

        By default special-token text inside `s` is encoded as ordinary text (as for
        pre-training data); pass `allowed_special` to map it to the special ids instead.
        """
        assert isinstance(s, str), type(s)
        ids: list[int] = [self._bos_id] if bos else []
        if s:
            pieces = list(_pieces(s))
            if len(pieces) == 1 and not allowed_special and not disallowed_special:
                ids.extend(self.model.encode_ordinary(pieces[0]))
            else:
                for piece in pieces:
                    ids.extend(
                        self.model.encode(piece, allowed_special=allowed_special, disallowed_special=disallowed_special)
                    )
        if eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        return self.model.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, n_words={self.n_words}, bos_id={self.bos_id}, eos_id={self.eos_id})"


class ByteTokenizer:
    """A file-free tokenizer for tests: UTF-8 bytes are ids 0..255, then the same 256
    special tokens as `Tokenizer` (BOS 256, EOS 257, eot 265; n_words 512)."""

    def __init__(self) -> None:
        names = llama3_special_token_names()
        self.special_tokens = {name: 256 + i for i, name in enumerate(names)}
        self.path = "byte"
        self.num_base_tokens = 256
        self._n_words = 256 + len(names)

    bos_id = property(lambda self: self.special_tokens["<|begin_of_text|>"])
    eos_id = property(lambda self: self.special_tokens["<|end_of_text|>"])
    eot_id = property(lambda self: self.special_tokens["<|eot_id|>"])
    n_words = property(lambda self: self._n_words)
    vocab_size = n_words

    def encode(self, s: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = ([self.bos_id] if bos else []) + list(s.encode("utf-8"))
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids: Sequence[int]) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(n_words=512)"


def build_tokenizer(path: str | os.PathLike, sha256: str | None = None) -> Tokenizer | ByteTokenizer:
    """The tokenizer at `path`, checked against `sha256` if given.

    Short names are accepted too: "llama3" (assets' Llama 3 file, checked against Meta's
    sha256), "proxy" / "proxy_bpe_4k" (assets' proxy file) and "byte" (ByteTokenizer).
    """
    name = str(path)
    if name == "byte":
        return ByteTokenizer()
    if name in ("llama3", "proxy", "proxy_bpe_4k"):
        if name == "llama3":
            return Tokenizer(llama3_tokenizer_path(), expected_sha256=sha256 or LLAMA3_TOKENIZER_SHA256)
        return Tokenizer(proxy_tokenizer_path(), expected_sha256=sha256)
    return Tokenizer(path, expected_sha256=sha256)
