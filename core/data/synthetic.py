"""The synthetic corpus: deterministic, learnable documents made in code (tests, parity; no files)."""

from __future__ import annotations

import random


def synthetic_document(index: int, split: str = "train") -> str:
    """Document `index` of the synthetic corpus: an arithmetic sequence in words and digits.

    Learnable (after two numbers the rest follows) and fully determined by (split, index).
    """
    rng = random.Random((0 if split == "train" else 7_919) * 1_000_003 + index)
    start, step, count = rng.randrange(0, 1000), rng.randrange(1, 13), rng.randrange(16, 96)
    numbers = " ".join(str(start + k * step) for k in range(count))
    return f"Count from {start} in steps of {step}: {numbers}."


class SyntheticDocuments:
    """`num_docs` synthetic documents per pass; position is just the next index."""

    def __init__(self, split: str = "train", num_docs: int | None = None, rank: int = 0, world: int = 1):
        self.split = split
        self.num_docs = num_docs if num_docs is not None else (100_000 if split == "train" else 1_000)
        self.rank, self.world = rank, world  # per-rank sharding: documents rank, rank + world, ...
        self._next = rank

    def open(self, position: dict | None) -> None:
        self._next = int(position["index"]) if position else self.rank

    def next_text(self) -> str:
        if self._next >= self.num_docs:
            raise StopIteration
        text = synthetic_document(self._next, self.split)
        self._next += self.world
        return text

    def position(self) -> dict:
        return {"index": self._next}
