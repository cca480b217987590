"""Which documents a data-parallel rank reads (`data.sharding`).

global    every rank reads and tokenizes the whole global token stream and keeps its slice of
          each global batch: the same global batch for any DP degree (loss parity, the proxies),
          and one loader state serves any rank and degree on resume. At 512 ranks it tokenizes
          every token 512 times.
per_rank  each DP rank reads and tokenizes only its own documents (whole shard files when their
          count divides by the DP degree, as C4 en's 1024 train shards do; else every DP-degree-th
          document) and packs its own windows. Scales; the batches depend on the DP degree, and a
          resume needs the same rank of the same degree (its state says which).
auto      per_rank in real mode, global otherwise.
"""

from __future__ import annotations

from typing import Any

SHARDINGS = ("global", "per_rank")


def data_sharding(cfg: Any) -> str:
    """`data.sharding` resolved: "auto" is per_rank in real mode, global otherwise (proxies, parity)."""
    choice = getattr(cfg.data, "sharding", "global")
    if choice == "auto":
        return "per_rank" if getattr(cfg.job, "mode", "proxy") == "real" else "global"
    return choice


def split_by_rank(dataset: Any, rank: int, world: int) -> Any:
    """This DP rank's part of a Hugging Face streaming dataset (shards when they divide by world)."""
    if world == 1:
        return dataset
    from datasets.distributed import split_dataset_by_node  # local: HF datasets costs seconds to import

    return split_dataset_by_node(dataset, rank=rank, world_size=world)


def own_files(files: list[str], rank: int, world: int) -> list[str]:
    """The shard files `split_by_rank` gives a DP rank: every world-th file from its own when
    the count divides by the degree (datasets' shard strategy, `contiguous=False`), else all of
    them (it then takes every world-th document of each)."""
    return files[rank::world] if world > 1 and len(files) % world == 0 else files


def sharding_state(sharding: str, dp_rank: int, dp_degree: int) -> dict:
    """What a per-rank loader state adds: whose documents it holds (global states add nothing)."""
    if sharding != "per_rank":
        return {}
    return {"sharding": "per_rank", "dp_rank": dp_rank, "dp_degree": dp_degree}


def check_resume_state(state: dict, sharding: str, dp_rank: int, dp_degree: int) -> None:
    """ValueError unless a saved loader state can continue on this rank exactly."""
    mine = (sharding, dp_rank, dp_degree) if sharding == "per_rank" else ("global",)
    theirs = (state.get("sharding", "global"), state.get("dp_rank"), state.get("dp_degree"))[: len(mine)]
    if theirs != mine:
        raise ValueError(
            f"loader state is of data sharding {theirs}, this loader is {mine}: per-rank sharding "
            "resumes only on the same DP rank of the same DP degree (data.sharding = 'global' "
            "can change the layout mid-run)"
        )
