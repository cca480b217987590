"""What `run-recipe plan --gpus N` prints: the ranked layouts (a table or JSON) and where each of
the paper's layouts for the setting ranks among them, and why; and how every plan prints its
rates and days (`rate_text`, `days_text`: budget.py's answer too)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type names only
    from recipes.plan.candidate import Candidate


def paper_layouts(model: str, gpus: int, seq: int) -> list:
    """The paper's rows with this model, GPU count and sequence length."""
    from recipes import registry

    rows = []
    for r in registry.all_recipes():
        if r.gpus != gpus:
            continue
        cfg = r.job_config("real")
        if cfg.model.flavor == model and cfg.training.seq_len == seq:
            rows.append((r, cfg))
    return rows


def ranked_json(ranked: list[Candidate], gpu: str, software: str) -> str:
    import json

    return json.dumps(
        [
            {
                "rank": i,
                "layout": c.layout(),
                "degrees": c.degrees,
                "ac": c.ac,
                "local_batch": c.local_batch,
                "estimate_gib": round(c.estimate_gib, 2),
                "fits": c.fits,
                "memory_band_pct": round(c.memory_band * 100, 1) if c.memory_band is not None else None,
                "within_memory_band_of_limit": c.near_limit,
                "violations": c.violations,
                "gpu": gpu,
                "software": software,
                "tokens_per_sec_per_gpu": rate_json(c.tps),
                "step_time_s": round(c.predicted["step_time_s"], 4),
                "mfu": round(c.predicted["mfu"], 4),
                "error_band_pct": round(c.band * 100, 1) if c.band is not None else None,
            }
            for i, c in enumerate(ranked, 1)
        ],
        indent=2,
    )


def rate_text(rate: float) -> str:
    """Tokens/s as plan prints them: whole numbers from 100 up, else three significant digits (a
    measured CPU spec predicts well under one token/s per GPU for a real model)."""
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def rate_json(rate: float) -> float:
    """Tokens/s in plan's JSON: one decimal, or three significant digits below 100 (as printed)."""
    return round(rate, 1) if rate >= 100 else float(f"{rate:.3g}")


def days_text(days: float, budget: float) -> str:
    """Predicted days beside a budget of days: one decimal, or as many more as it takes for the
    figure to read on its own side of the budget (30.05 days is no '30.0' under a 30-day budget);
    past four decimals a miss rounds up and a hit down."""
    for places in range(1, 5):
        text = f"{days:.{places}f}"
        if (float(text) <= budget) == (days <= budget):
            return text
    rounded = (math.floor if days <= budget else math.ceil)(days * 1e4) / 1e4
    return f"{rounded:.4f}"


def ranked_table(shown: list[Candidate], gpu_mem: float) -> str:
    from tabulate import tabulate

    rows = []
    for i, c in enumerate(shown, 1):
        ac = c.ac if c.ac != "selective" else "selective op"
        rows.append(
            [
                i,
                c.layout(),
                c.local_batch,
                ac,
                f"{c.estimate_gib:.1f}",
                f"±{c.memory_band:.1%}" if c.memory_band is not None else "-",
                c.fit_text(),
                rate_text(c.tps),
                f"±{c.band:.1%}" if c.band is not None else "-",
                f"{c.predicted['mfu']:.1%}",
                "; ".join(c.violations) or "-",
            ]
        )
    memory = f"est. GiB (of {gpu_mem:g})"
    headers = [
        "#",
        "layout",
        "local batch",
        "AC",
        memory,
        "mem. band",
        "fits",
        "pred. TPS/GPU",
        "band",
        "MFU",
        "against the guidance",
    ]
    return tabulate(rows, headers=headers)


def against_the_paper(ranked: list[Candidate], model: str, gpus: int, seq: int) -> list[str]:
    """Where each of the paper's layouts for this setting ranks here, and why it is not first."""
    best, lines = ranked[0], []
    for r, cfg in paper_layouts(model, gpus, seq):
        p = cfg.parallelism
        want = {"dp_shard": p.dp_shard, "tp": p.tp, "pp": p.pp, "cp": p.cp}
        pos = next((i for i, c in enumerate(ranked, 1) if c.degrees == want), None)
        lb = cfg.training.local_batch_size
        if pos == 1:
            lines.append(f"paper ({r.id}): the same layout.")
            continue
        if pos is None:
            lines.append(
                f"paper ({r.id}): {_paper_layout(want)} -- not a candidate here (its local batch "
                f"{lb} does not fit this plan's batch rule: pass --local-batch {lb})"
            )
            continue
        c = ranked[pos - 1]
        why = [
            f"ranked {pos}, {c.estimate_gib:.1f} GiB at local batch {c.local_batch}, predicted "
            f"{rate_text(c.tps)} tokens/s per GPU" + ("" if c.fits else " (does not fit)")
        ]
        if c.local_batch != lb:
            why.append(f"the paper ran local batch {lb}: pass --local-batch {lb}")
        if c.fits and best.fits:
            why.append(f"{best.layout()} also fits and is predicted faster ({rate_text(best.tps)} tokens/s per GPU)")
        lines.append(f"paper ({r.id}): {_paper_layout(want)} -- " + "; ".join(why))
    return lines


def _paper_layout(d: dict) -> str:
    names = {"dp_shard": "FSDP", "tp": "TP", "pp": "PP", "cp": "CP"}
    return " x ".join(f"{names[k]} {v}" for k, v in d.items() if v > 1) or "1 GPU"
