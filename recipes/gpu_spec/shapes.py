"""The configurations whose shapes `run-recipe gpu-spec --measure` measures, and the one-device
layouts `run-recipe preflight --gpus 1` runs: a GPU measures the GEMMs of the paper's 8B and 70B
at their TP shards; a CPU the ones of the proxy its preflight trains.
"""

from __future__ import annotations

from core.config import JobConfig

# The CPU form of `preflight --gpus 1`: one process, bf16 (autocast, the trainer's bf16 GEMM route
# core/cpu_gemm.py), large enough that matmuls, not per-op dispatch, take most of a step.
PROXY = {"flavor": "debug", "seq": 256, "local_batch": 4}
PROXY_QUICK = {"flavor": "tiny", "seq": 64, "local_batch": 2}  # the tests' sizes
# The CUDA form: an 8B-shaped model (its widths, Llama 3's vocabulary) with as many of its 32 blocks
# as fit one GPU, seq 8192 (the one-GPU layout).
ONE_GPU = {"flavor": "8B", "seq": 8192, "local_batch": 1}
GPU_SHAPES = (("8B", 1), ("8B", 8), ("70B", 8))  # (model, TP degree) of the GEMMs a GPU measures
GPU_SHAPES_QUICK = (("8B", 8),)


def layout_config(
    flavor: str,
    seq: int,
    local_batch: int,
    ac: str = "none",
    tp: int = 1,
    n_layers: int = 0,
    compile_: bool = False,
    float8: bool = False,
) -> JobConfig:
    """One rank's config (bf16 compute, fp32 reduce, synthetic data) for the shapes and the
    one-device runs; `ac` none | full | selective (op, every other matmul saved)."""
    from recipes.plan.layouts import base_config  # the paper's shared setup, as the layout advisor builds it

    cfg = base_config(flavor, seq, local_batch)
    cfg.model.n_layers = n_layers
    cfg.parallelism.tp = tp
    cfg.parallelism.world_size = tp
    cfg.activation_checkpoint.mode = ac
    cfg.activation_checkpoint.selective_ac_option = "op"
    cfg.activation_checkpoint.save_every_other_mm = True
    cfg.compile.enabled = compile_
    cfg.float8.enabled = float8
    return cfg


def measured_configs(device_kind: str, quick: bool = False) -> list[JobConfig]:
    """The configs whose GEMMs are measured; the first one's sequence and widths also size the
    attention and pointwise benchmarks."""
    if device_kind == "cpu":
        p = PROXY_QUICK if quick else PROXY
        return [layout_config(p["flavor"], p["seq"], p["local_batch"])]
    return [layout_config(m, ONE_GPU["seq"], 1, tp=tp) for m, tp in (GPU_SHAPES_QUICK if quick else GPU_SHAPES)]


def attention_lengths(device_kind: str, seq: int, quick: bool = False) -> list[int]:
    """Sequence lengths of the SDPA benchmark: the config's and its halves (and double on a GPU)."""
    if quick:
        return [seq]
    return [seq // 2, seq] if device_kind == "cpu" else [seq // 4, seq // 2, seq]
