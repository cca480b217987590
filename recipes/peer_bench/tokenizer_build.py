"""The tokenizer torchtitan's HuggingFaceTokenizer loads for the peer benchmark: a byte-level BPE
of VOCAB ids (the debug model's vocabulary) trained with the `tokenizers` library on the `text`
of a JSON-lines corpus, saved as tokenizer.json + tokenizer_config.json (bos/eos).

Run by the peer venv's interpreter (it has `tokenizers`, a torchtitan dependency), by path:

    python tokenizer_build.py CORPUS_JSONL OUT_DIR

Standard library and `tokenizers` only: nothing of this project is imported.
"""

from __future__ import annotations

import json
import os
import sys

VOCAB = 2048  # torchtitan's llama3 debug model has 2,048 embeddings: every id must be below it
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHECK = "Now is the winter of our discontent, 1592."


def corpus_texts(path: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train(corpus: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown input
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(corpus), trainer=trainer)
    if tok.get_vocab_size() > VOCAB:
        raise SystemExit(f"tokenizer_build: {tok.get_vocab_size()} ids, more than the model's {VOCAB}")
    if tok.decode(tok.encode(CHECK).ids) != CHECK:
        raise SystemExit("tokenizer_build: decode(encode(x)) != x")
    return tok


def save(tok, out_dir: str) -> None:
    """tokenizer.json and the config torchtitan reads its bos/eos tokens from, into `out_dir` (the
    caller's staging folder: it moves them into place with the project's atomic writer)."""
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "normalized": False} for t in (BOS, EOS)
        },
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    corpus, out_dir = argv
    tok = train(corpus)
    save(tok, out_dir)
    print(f"tokenizer_build: {tok.get_vocab_size()} ids ({BOS}={tok.token_to_id(BOS)}, {EOS}={tok.token_to_id(EOS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
