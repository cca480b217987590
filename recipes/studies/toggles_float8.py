"""The Float8 section of the toggle benchmarks: loss deviation and step-time ratio of each torchao
recipe against bf16 at world 1, and FSDP2 with float8 all-gather at world 2 against FSDP2 bf16."""

from __future__ import annotations

import tempfile

from core.config import load_config
from core.reference import reference_run
from core.validate import validate
from recipes import modes
from recipes.studies.common import one_rank_group
from recipes.studies.toggles_interleaved import bench_overrides, interleaved, max_diff, median

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_deviation(flavor: str = "tiny", seq_len: int = 64, batch: int = 8, steps: int = 10) -> list[dict]:
    """bf16 autocast vs each float8 recipe (world 1, trainers interleaved): max |loss diff| over
    the steps, step time ratio. The tiny shape: CPU `_scaled_mm` runs ~35 ns per multiply-add.
    `tensorwise_emulated` is what the CPU proxy rows run (torchao's fp32 emulation)."""
    base = bench_overrides(flavor, seq_len, batch, steps, "bfloat16")
    variants = {
        "bf16": [],
        **{r: ["float8.enabled=true", f"float8.recipe={r}"] for r in FLOAT8_RECIPES},
        "tensorwise_emulated": ["float8.enabled=true", "float8.emulate=true"],
    }
    with one_rank_group(), tempfile.TemporaryDirectory() as tmp:
        runs = interleaved(base, variants, steps, warmup=0, out=tmp)
    ref = runs.pop("bf16")
    # warmup=0: every step's loss is compared; times drop the first step (lazy init)
    return [
        {
            "recipe": r,
            "max_loss_diff": max_diff(run["losses"], ref["losses"]),
            "final_loss": run["losses"][-1],
            "bf16_final_loss": ref["losses"][-1],
            "time_ratio": median(run["times"][1:]) / median(ref["times"][1:]),
            "applied": list(run["trainer"].toggles.applied),
        }
        for r, run in runs.items()
    ]


def float8_fsdp(flavor: str = "tiny", seq_len: int = 64, batch: int = 8, steps: int = 10) -> dict:
    """FSDP2 world 2, bf16 params + float8 all-gather + precomputed scales, vs the bf16 single
    process reference (core.reference, bf16 autocast) on the same global batch."""
    base = bench_overrides(flavor, seq_len, batch, steps, "bfloat16")
    ref = reference_run(validate(load_config(None, base), 1, check_files=False))["losses"]
    fp8 = [
        "float8.enabled=true",
        "float8.enable_fsdp_float8_all_gather=true",
        "float8.precompute_float8_dynamic_scale_for_fsdp=true",
    ]
    world2 = bench_overrides(flavor, seq_len, batch // 2, steps, "bfloat16") + ["--parallelism.dp_shard=2"]
    out, losses = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("bf16", []), ("float8", fp8)):
            rec = modes.launch_trainer(2, world2 + ["--" + o for o in extra], f"{tmp}/{name}")
            losses[name] = rec["losses"]
            out[name] = {
                "max_loss_diff": max_diff(rec["losses"], ref),
                "step_s": median(rec["step_times_s"][1:]),
                "applied": rec["toggles_applied"],
            }
    out["float8_vs_fsdp_bf16"] = max_diff(losses["float8"], losses["bf16"])  # the float8 effect alone
    out["shape"] = f"{flavor}, seq {seq_len}, global batch {batch}, {steps} steps, FSDP2 world 2"
    return out
