"""Data layer: tokenizers, offline assets, datasets, packing, DP slicing, exact resume."""

from __future__ import annotations

import gzip
import json
import struct
import time
from pathlib import Path

import pytest
import torch

from core.data import assets
from core.data import corpus as offline_corpus
from core.data.datasets import (
    DATASETS,
    DatasetUnavailableError,
    TokenWindowLoader,
    check_hub_reachable,
    synthetic_document,
)
from core.data.tokenizer import LLAMA3_TOKENIZER_SHA256, PROXY_TOKENIZER_SHA256, ByteTokenizer, Tokenizer, _pieces

pytestmark = pytest.mark.core


# --------------------------------------------------------------------------------------------
# fixtures: the real assets, built once if absent (PyPI only; cached under assets/)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def assets_root() -> Path:
    return assets.default_assets_root()


@pytest.fixture(scope="session")
def llama3(assets_root) -> Tokenizer:
    path = assets.build_llama3_tokenizer(assets_root)  # skips if present and verified
    return Tokenizer(path, expected_sha256=LLAMA3_TOKENIZER_SHA256)


@pytest.fixture(scope="session")
def corpus(assets_root) -> Path:
    return assets.build_offline_corpus(assets_root)


@pytest.fixture(scope="session")
def proxy(assets_root, corpus) -> Tokenizer:
    return Tokenizer(assets.build_proxy_tokenizer(assets_root))


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


ROUND_TRIP = [
    "Hello, world!",
    "",
    "  leading and trailing spaces  \n\n\ttabs\r\nCRLF",
    "Unicode: naïve café, Ελληνικά, русский, 日本語, 🙂🚀, and the digits 1234567.",
    "<|begin_of_text|> special-token text is ordinary text <|eot_id|>",
    "x" * 30_000 + " " * 26_000 + "tail",  # runs longer than the 25k-character cut
]


# --------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------
def test_llama3_ids(llama3):
    assert llama3.encode("Hello, world!", bos=False, eos=False) == [9906, 11, 1917, 0]
    assert llama3.encode("Hello, world!", bos=True, eos=True) == [128000, 9906, 11, 1917, 0, 128001]
    assert (llama3.bos_id, llama3.eos_id, llama3.eot_id) == (128000, 128001, 128009)
    assert llama3.n_words == 128256 == llama3.model.n_vocab
    st = llama3.special_tokens
    assert st["<|finetune_right_pad_id|>"] == 128004
    assert st["<|start_header_id|>"] == 128006 and st["<|end_header_id|>"] == 128007
    assert st["<|eom_id|>"] == 128008 and st["<|python_tag|>"] == 128010
    assert st["<|reserved_special_token_2|>"] == 128011
    assert st["<|reserved_special_token_246|>"] == 128255 and len(st) == 256
    assert llama3.encode("<|eot_id|>", allowed_special="all") == [128009]


def test_llama3_round_trip(llama3):
    for s in ROUND_TRIP:
        assert llama3.decode(llama3.encode(s)) == s
    assert "<|begin_of_text|>" not in [llama3.decode([i]) for i in llama3.encode(ROUND_TRIP[4])]


def test_long_string_pieces_rejoin():
    s = "ab " * 150_000 + "z" * 60_000 + "\n" * 30_000
    pieces = list(_pieces(s))
    assert "".join(pieces) == s and len(pieces) > 2
    assert max(map(len, pieces)) <= 400_000


def test_tokenizer_file_errors(llama3, tmp_path):
    with pytest.raises(ValueError, match=r"sha256.*core\.data\.assets --llama3-tokenizer"):
        Tokenizer(llama3.path, expected_sha256="0" * 64)
    missing = tmp_path / "tokenizer" / "llama3" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.model.*python -m core\.data\.assets --llama3-tokenizer"):
        Tokenizer(missing)
    with pytest.raises(FileNotFoundError, match=r"--proxy-tokenizer"):
        Tokenizer(tmp_path / "proxy_bpe_4k" / "tokenizer.model")


def test_tokenizer_reads_file_content_not_a_cache(tmp_path):
    # tiktoken caches files by path; a changed file at the same path must not read stale ranks
    path = tmp_path / "tokenizer.model"
    path.write_bytes(assets.tiktoken_bpe_bytes([(bytes([i]), i) for i in range(256)]))
    assert Tokenizer(path).n_words == 512
    path.write_bytes(assets.tiktoken_bpe_bytes([(bytes([i]), i) for i in range(256)] + [(b"ab", 256)]))
    tok = Tokenizer(path)
    assert tok.n_words == 513 and tok.encode("ab") == [256]


def test_proxy_tokenizer(proxy, assets_root):
    assert proxy.n_words == 4352 and proxy.num_base_tokens == 4096
    assert (proxy.bos_id, proxy.eos_id, proxy.eot_id) == (4096, 4097, 4105)
    for s in ROUND_TRIP + list(assets.iter_corpus_texts(assets_root, "validation"))[:20]:
        assert proxy.decode(proxy.encode(s)) == s
    text = "To be, or not to be, that is the question"
    assert len(proxy.encode(text)) < len(text.encode()) / 2.5  # it did learn merges
    assert proxy.sha256 == PROXY_TOKENIZER_SHA256, "proxy vocabulary differs from the pinned one (rustbpe version?)"


def test_byte_tokenizer():
    t = ByteTokenizer()
    assert (t.bos_id, t.eos_id, t.n_words) == (256, 257, 512)
    assert t.decode(t.encode("héllo", bos=True, eos=True)) == "héllo"


# --------------------------------------------------------------------------------------------
# assets (pure parts) and the corpus layout
# --------------------------------------------------------------------------------------------
def test_quicktok_vocab_parser():
    entries = [(b"a", 1), (b"\x00", 0), (b"ab", 2)]
    blob = struct.pack("<I", 3) + b"".join(struct.pack("<H", len(t)) + t + struct.pack("<I", r) for t, r in entries)
    assert assets.parse_quicktok_vocab(blob) == entries
    assert assets.tiktoken_bpe_bytes(entries) == b"AA== 0\nYQ== 1\nYWI= 2\n"
    with pytest.raises(assets.AssetError, match="truncated|malformed"):
        assets.parse_quicktok_vocab(blob[:-2])
    with pytest.raises(assets.AssetError, match="trailing"):
        assets.parse_quicktok_vocab(blob + b"\x00")


def test_gutenberg_boilerplate_and_documents():
    body = "\n\n".join(f"LINE {i}.\nSome verse that runs on for a while, {i}." for i in range(400))
    raw = (
        "The Project Gutenberg EBook of Something\r\nLegal text.\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***\r\n\r\n"
        + body.replace("\n", "\r\n")
        + "\r\n\r\nEnd of the Project Gutenberg EBook\r\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nmore legal"
    )
    text = offline_corpus.strip_gutenberg_boilerplate(raw)
    assert "Gutenberg" not in text and "legal" not in text.lower() and "\r" not in text
    assert text.strip() == body
    docs = offline_corpus.split_into_documents(text)
    assert len(docs) > 5 and "\n\n".join(docs) == body
    assert all(offline_corpus.DOC_MIN_CHARS <= len(d) <= 2 * offline_corpus.DOC_TARGET_CHARS for d in docs)


def test_corpus_layout(corpus, assets_root):
    en = corpus / "en"
    assert [p.name for p in sorted(en.glob("c4-train.*"))] == [f"c4-train.0000{i}-of-00004.json.gz" for i in range(4)]
    assert [p.name for p in en.glob("c4-validation.*")] == ["c4-validation.00000-of-00001.json.gz"]
    with gzip.open(en / "c4-train.00000-of-00004.json.gz", "rt") as f:
        rec = json.loads(f.readline())
    assert list(rec) == ["text", "timestamp", "url"] and len(rec["text"]) > 500

    def works(split):
        out = set()
        for p in en.glob(f"c4-{split}.*"):
            with gzip.open(p, "rt") as f:
                out |= {json.loads(line)["url"].split("#")[1].rsplit("-", 1)[0] for line in f}
        return out

    assert works("validation") == set(offline_corpus.VALIDATION_WORKS)
    assert not works("validation") & works("train")
    manifest = json.loads((assets_root / "MANIFEST.json").read_text())
    assert manifest["assets"]["c4_offline"]["documents"]["train"] > 2000


# --------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------
def test_packing_is_the_document_stream_cut_into_windows():
    tok = ByteTokenizer()
    S, B = 37, 3
    loader = TokenWindowLoader("synthetic", tokenizer=tok, seq_len=S, local_batch_size=B)
    batches = take(loader, 5)
    stream = [t for i in range(200) for t in tok.encode(synthetic_document(i), bos=True, eos=True)]
    got = []
    for x, y in batches:
        assert x.shape == y.shape == (B, S) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one
        for row_x, row_y in zip(x, y, strict=True):
            got.extend(row_x.tolist() + row_y[-1:].tolist())  # a window of S + 1 tokens
    assert got == stream[: len(got)]  # nothing dropped, reordered or overlapped


def test_packing_real_corpus_boundaries(proxy, corpus):
    loader = TokenWindowLoader("c4_offline", tokenizer=proxy, seq_len=512, local_batch_size=4)
    x, y = next(loader)
    assert x[0, 0].item() == proxy.bos_id  # the stream starts with a document
    assert torch.equal(x[:, 1:], y[:, :-1])
    window = torch.cat([x, y[:, -1:]], dim=1).flatten()
    eos = (window == proxy.eos_id).nonzero().flatten().tolist()
    assert eos, "a 2k-token stretch holds a document boundary"
    for i in eos:  # every document ends with EOS and the next one starts with BOS
        if i + 1 < len(window):
            assert window[i + 1].item() == proxy.bos_id
    first_doc = next(assets.iter_corpus_texts(corpus.parent, "train"))
    ids = proxy.encode(first_doc, bos=True, eos=True)
    n = min(len(ids), 513)
    assert window[:n].tolist() == ids[:n]


# --------------------------------------------------------------------------------------------
# data-parallel slicing
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset", ["synthetic", "c4_offline"])
def test_dp_slicing_gives_one_global_batch(dataset, proxy):
    global_batch, S, steps = 8, 64, 3
    tok = proxy if dataset == "c4_offline" else None
    reference = take(TokenWindowLoader(dataset, tokenizer=tok, seq_len=S, local_batch_size=global_batch), steps)
    for dp in (2, 4):
        ranks = [
            take(
                TokenWindowLoader(
                    dataset, tokenizer=tok, seq_len=S, local_batch_size=global_batch // dp, dp_rank=r, dp_degree=dp
                ),
                steps,
            )
            for r in range(dp)
        ]
        for step in range(steps):
            x = torch.cat([ranks[r][step][0] for r in range(dp)])
            y = torch.cat([ranks[r][step][1] for r in range(dp)])
            assert torch.equal(x, reference[step][0]) and torch.equal(y, reference[step][1])


# --------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset", ["synthetic", "c4_offline"])
def test_resume_continues_on_the_next_token(dataset, proxy):
    tok = proxy if dataset == "c4_offline" else None

    def make():
        return TokenWindowLoader(dataset, tokenizer=tok, seq_len=100, local_batch_size=3)

    uninterrupted = take(make(), 9)
    first = make()
    take(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # plain data: survives any serializer
    assert state["token_buffer"], "a partly used document is carried over"
    resumed = make()
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 5), uninterrupted[4:])


def test_resume_across_the_end_of_the_corpus(proxy):
    # the validation split (~130k proxy tokens) ends after ~8 global batches of 16k tokens
    def make():
        return TokenWindowLoader("c4_offline", tokenizer=proxy, seq_len=2047, local_batch_size=8, split="validation")

    uninterrupted = make()
    ref = take(uninterrupted, 12)
    assert uninterrupted.epoch == 1
    first = make()
    take(first, 6)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert_batches_equal(take(resumed, 6), ref[6:])
    finite = TokenWindowLoader(
        "c4_offline", tokenizer=proxy, seq_len=2047, local_batch_size=8, split="validation", infinite=False
    )
    n = sum(1 for _ in finite)
    assert 4 <= n < 12 and finite.epoch == 0


def test_resume_with_another_dp_degree():
    # the state is a position in the global stream: a dp=1 checkpoint resumes on dp=2 ranks
    first = TokenWindowLoader("synthetic", seq_len=50, local_batch_size=4)
    ref = take(TokenWindowLoader("synthetic", seq_len=50, local_batch_size=4), 5)
    take(first, 3)
    state = first.state_dict()
    ranks = []
    for r in range(2):
        loader = TokenWindowLoader("synthetic", seq_len=50, local_batch_size=2, dp_rank=r, dp_degree=2)
        loader.load_state_dict(state)
        ranks.append(take(loader, 2))
    for step in range(2):
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), ref[3 + step][0])


def test_state_of_another_dataset_is_refused():
    loader = TokenWindowLoader("synthetic", seq_len=8)
    state = loader.state_dict() | {"dataset": "c4"}
    with pytest.raises(ValueError, match="c4"):
        loader.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
def test_missing_corpus_names_path_and_command(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as e:
        TokenWindowLoader("c4_offline", path=str(missing), tokenizer=ByteTokenizer(), seq_len=8)
    assert str(missing) in str(e.value) and "python -m core.data.assets --corpus" in str(e.value)


def test_unknown_dataset_and_bad_args():
    with pytest.raises(ValueError, match="known"):
        TokenWindowLoader("c5", tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="dp_rank"):
        TokenWindowLoader("synthetic", dp_rank=2, dp_degree=2)
    assert set(DATASETS) >= {"c4", "c4_offline", "synthetic"}


def test_c4_offline_mode_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match=r'data\.dataset = "c4_offline"'):
        TokenWindowLoader("c4", tokenizer=ByteTokenizer(), seq_len=8)
    assert time.monotonic() - t0 < 5


def test_unreachable_hub_fails_fast(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # nothing listens on the discard port
    t0 = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match=r"not reachable.*c4_offline.*--corpus"):
        check_hub_reachable()
    with pytest.raises(DatasetUnavailableError, match="c4_offline"):
        TokenWindowLoader("c4", tokenizer=ByteTokenizer(), seq_len=8)
    assert time.monotonic() - t0 < 5


def test_build_dataloader_from_a_job_config(proxy, corpus):
    from types import SimpleNamespace

    from core.data.datasets import build_dataloader

    cfg = SimpleNamespace(
        data=SimpleNamespace(dataset="c4_offline", path=str(corpus)),
        training=SimpleNamespace(seq_len=32, local_batch_size=2, dataset_infinite=True),
    )
    x, y = next(build_dataloader(cfg, proxy, dp_rank=1, dp_degree=2, vocab_size=proxy.n_words))
    assert x.shape == y.shape == (2, 32)
    cfg.data.dataset = "synthetic"
    assert next(build_dataloader(cfg, None, dp_rank=0, dp_degree=1, vocab_size=4352))[0].max() < 512
    with pytest.raises(ValueError, match="vocabulary"):
        build_dataloader(cfg, None, dp_rank=0, dp_degree=1, vocab_size=300)
