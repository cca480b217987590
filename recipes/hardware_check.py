"""Can this node run a recipe row for real: what a real run needs (GPUs, compute capability,
NVSwitch) against what the node has, listing what is missing (used by `run-recipe run` and `show`)."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, JobConfig
from core.hardware import check_toggle_hardware
from recipes.schema import Recipe


@dataclass
class HardwareReport:
    missing: list[str]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not self.missing


def _sm(token: str) -> tuple[int, int] | None:
    if token.startswith("sm") and token[2:].isdigit() and len(token) >= 4:
        return int(token[2:-1]), int(token[-1])
    return None


def real_requirements(recipe: Recipe, cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(hard, advisory) requirements of a real run of cfg: the recipe's list plus what the config
    itself implies (GPU count, sm89 for Float8, sm90 + NVSwitch for AsyncTP)."""
    world = cfg.parallelism.world_size
    hard = [t for t in recipe.requires.get("real", ()) if not t.startswith("cuda>=")]
    hard.insert(0, f"cuda>={world}")
    if cfg.float8.enabled and not cfg.float8.emulate and "sm89" not in hard:
        hard.append("sm89")
    advisory = list(recipe.requires.get("advisory", ()))
    if cfg.parallelism.enable_async_tp and cfg.parallelism.tp > 1:
        advisory += [t for t in ("sm90", "nvswitch") if t not in advisory]
    return hard, advisory


def check_node(recipe: Recipe, cfg: JobConfig) -> HardwareReport:
    """Can this node run cfg for real, single-node? Lists what is missing, never guesses."""
    import torch  # here, not at the top: `run-recipe list` and `show` must not pay torch's import

    hard, advisory = real_requirements(recipe, cfg)
    world = cfg.parallelism.world_size
    missing: list[str] = []
    notes: list[str] = []
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        missing.append(
            f"CUDA: not available (torch {torch.__version__} is {build}; no GPU visible); needs {world} GPUs"
        )
        caps = []
    else:
        n = torch.cuda.device_count()
        if n < world:
            missing.append(f"GPUs: {world} needed on this node, {n} visible")
        caps = [torch.cuda.get_device_capability(i) for i in range(n)]
    if "sm89" in hard and caps:  # Float8 matmuls: CUDA sm89+, or an FP8-capable ROCm part
        from core.toggles.float8 import device_fp8_problem

        problem = next(filter(None, map(device_fp8_problem, range(len(caps)))), None)
        if problem:
            missing.append(f"compute capability sm89 (Float8 matmuls): {problem}")
    for token in advisory:
        need = _sm(token)
        if need:
            have = "sm{}{}".format(*min(caps)) if caps else "no GPU"
            if not caps or min(caps) < need:
                notes.append(f"AsyncTP wants {token} (symmetric memory); this node: {have}")
        elif token == "nvswitch":
            notes.append("AsyncTP wants NVLink/NVSwitch between the TP ranks (not checked)")
    try:  # the trainer's own check (Float8 sm89+, AsyncTP: CUDA + NVLink/NVSwitch in real mode)
        check_toggle_hardware(cfg)
    except ConfigError as e:
        if str(e) not in missing:
            missing.append(str(e))
    return HardwareReport(missing, notes)
