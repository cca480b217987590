"""One layout `run-recipe plan` proposes: its degrees, AC, batch, memory estimate, the guidance
rules it breaks and (when ranked by speed) its predicted throughput. Its own module so the plan
command, the budget search and the report all name it without importing one another."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Candidate:
    degrees: dict
    ac: str
    local_batch: int
    estimate_gib: float
    fits: bool
    violations: list[str]
    cfg: object = dataclasses.field(default=None, repr=False)
    memory: dict | None = dataclasses.field(default=None, repr=False)  # estimate_memory's result
    predicted: dict | None = None  # core.dryrun.runtime.predict, when ranked by speed
    band: float | None = None  # the model's error over public figures of its kind (a fraction)
    memory_band: float | None = None  # the memory accounting's error over readings of its kind
    near_limit: bool = False  # the estimate fits, but not with its memory band: refused

    def fit_text(self) -> str:
        """'yes', 'no', or 'no: within ±4.1% of the limit' (fits only without its memory band)."""
        if self.fits:
            return "yes"
        return f"no: within ±{self.memory_band:.1%} of the limit" if self.near_limit and self.memory_band else "no"

    @property
    def tps(self) -> float:
        return self.predicted["tokens_per_sec_per_gpu"] if self.predicted else 0.0

    def key(self):
        # FSDP first, then TP, then PP, then CP: fewer non-FSDP dimensions, and TP before PP
        # before CP; then the cheapest AC, the shortest pipeline, the widest TP, the most headroom.
        d = self.degrees
        extra = [d["tp"] > 1, d["pp"] > 1, d["cp"] > 1]
        ac_rank = ["none", "selective", "full"].index(self.ac)
        return (
            not self.fits,
            len(self.violations),
            sum(extra),
            extra[2],
            extra[1],
            ac_rank,
            d["pp"],
            d["cp"],
            -d["tp"],
            self.estimate_gib,
        )

    def layout(self) -> str:
        names = {"dp_shard": "FSDP", "tp": "TP", "pp": "PP", "cp": "CP"}
        parts = [f"{names[k]} {self.degrees[k]}" for k in ("dp_shard", "tp", "pp", "cp") if self.degrees[k] > 1]
        return " x ".join(parts) or "1 GPU"
