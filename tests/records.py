"""Hand-made result records for the tables' tests, completed into conforming runs of their rows
(recipes/report/compliance.py): the row's configuration for the mode, its fingerprint, the
pinned assets, a clean commit on the pinned versions, every configured step. What a test sets
itself (figures, losses' tail, toggles) is kept."""

from __future__ import annotations

import copy

from core.data.verify import PINNED
from core.provenance import config_fingerprint
from core.versions import PINNED as VERSIONS
from recipes import registry

ASSETS = {  # what a proxy and a real run of a row read
    "proxy": {
        "data": {"dataset": "c4_offline", "asset": "c4_offline", "digest": PINNED["c4_offline"], "files": {}},
        "tokenizer": {"asset": "proxy_tokenizer", "sha256": PINNED["proxy_tokenizer"]},
    },
    "real": {
        "data": {"dataset": "c4", "name": "allenai/c4", "config": "en", "revision": "main"},
        "tokenizer": {"asset": "llama3_tokenizer", "sha256": PINNED["llama3_tokenizer"]},
    },
}


def conforming(rec: dict) -> dict:
    """`rec` (recipe, mode and what a test sets) as a record that passes the compliance check."""
    rec = copy.deepcopy(rec)
    mode = rec["mode"]
    rec["config"] = registry.resolve_config(registry.get(rec["recipe"]), mode).to_dict()
    rec["provenance"] = {
        "config_fingerprint": config_fingerprint(rec["config"]),
        "deviations": [],
        "assets": copy.deepcopy(ASSETS.get(mode)),
    }
    git = (rec.get("versions") or {}).get("git") or "abc1234"
    rec["versions"] = {
        "torch": f"{VERSIONS['torch']}+cpu",
        "torchao": VERSIONS["torchao"],
        "git": git,
        "git_dirty": False,
    }
    if mode == "dry-run":
        return rec
    steps = rec["config"]["training"]["steps"]
    losses = rec.get("losses") or [8.0]
    rec["losses"] = [losses[0]] * (steps - len(losses)) + losses[-steps:]
    rec["steps"], rec["start_step"] = steps, 0
    rec["hardware"] = {"peak_gemm_route": None, **(rec.get("hardware") or {})}
    return rec
