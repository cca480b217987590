"""`run-recipe plan`: propose FSDP / TP / PP / CP degrees for a model, a GPU count and a sequence
length, checked by the dry-run memory accounting (`core.dryrun.memory.estimate_memory`).

The paper's guidance, as rules (each candidate's violations are printed with it):

1. FSDP first: one dimension over all GPUs while it fits and the FSDP group stays at most
   FSDP_MAX_GROUP ranks (the paper's largest 1D row has 128 GPUs; beyond, its 2D row starts:
   all-gathers over hundreds of ranks are latency-bound and the global batch grows with them).
2. TP within a node (degree <= GPUs per node: its collectives need NVLink) when FSDP alone does
   not fit or its group would be too large. A TP degree that does not divide the model's heads
   and KV heads is rejected by the config validation.
3. PP across nodes when FSDP x TP still does not fit (the largest models): 1F1B, one microbatch
   per stage.
4. CP for long context: only when the sequence is long (>= LONG_CONTEXT tokens) and the
   layouts without it do not fit.
5. Activation checkpointing: the cheapest mode that fits (none, then selective op, then full).

Ranking (`run-recipe plan`): among the layouts that fit and follow the guidance (then those that
fit but break a rule), by tokens/s per GPU as the dry-run
performance model predicts it on --gpu (core.dryrun.runtime.predict); the rules above break ties
and order what does not fit. `candidates(..., by_speed=False)` keeps the rules-only order: fits in
--gpu-mem, then fewest rule violations, then fewest dimensions besides FSDP (TP before PP before
CP), then the cheapest AC, the smallest PP / CP, the widest TP, the most headroom.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import click

from core.dryrun.gpuspec import DEFAULT_GPU
from recipes.options import text_option
from recipes.plan.budget import DAYS, SECONDS_PER_DAY, TOKENS, Setup, software_of
from recipes.plan.candidate import Candidate
from recipes.plan.report import against_the_paper, days_text, ranked_json, ranked_table, rate_text

if TYPE_CHECKING:  # type names only: the spec module is loaded when a plan runs
    from core.dryrun.gpuspec import GPUSpec
    from core.dryrun.software import Software
    from core.dryrun.stack import Stack

DEFAULT_GPU_MEM = 80.0  # GiB per GPU without --gpu or --gpu-mem
FSDP_MAX_GROUP = 128
LONG_CONTEXT = 32768
SPEED_TIE = 0.03  # predicted tokens/s within 3% of the fastest: ordered by the rules
AC_ORDER = (("none", "op"), ("selective", "op"), ("full", "op"))  # cheapest recompute first


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_config(model: str, seq: int, local_batch: int, settings: list[str] | None = None):
    """The paper's shared setup (bf16 params, fp32 reduce, AdamW) for a model and sequence, over
    `settings` (`--set` form: a software's own defaults, core/dryrun/stack.py config_settings)."""
    from core.config import load_config

    cfg = load_config(None, settings)
    cfg.model.flavor = model
    cfg.training.seq_len = seq
    cfg.training.local_batch_size = local_batch
    cfg.training.mixed_precision_param = "bfloat16"
    cfg.training.mixed_precision_reduce = "float32"
    cfg.data.dataset = "synthetic"
    cfg.job.mode = "dry-run"
    return cfg


def _layouts(gpus: int, gpus_per_node: int, n_layers: int):
    """(dp_shard, tp, pp, cp) of every split of `gpus`: TP within a node, CP a power of two up to
    16, PP at most half the layers (two per stage)."""
    for tp in [d for d in _divisors(gpus) if d <= gpus_per_node]:
        for cp in [c for c in _divisors(gpus // tp) if c == 1 or (c & (c - 1) == 0 and c <= 16)]:
            for pp in [p for p in _divisors(gpus // (tp * cp)) if p <= n_layers // 2 or p == 1]:
                yield gpus // (tp * cp * pp), tp, pp, cp


def _local_batch(dp: int, pp: int, local_batch: int | None, global_batch: int | None) -> int | None:
    """Sequences per data-parallel rank: `global_batch` split over the dp ranks, else
    `local_batch`, else 1 (one per stage with PP); None where it does not split."""
    if global_batch:
        if global_batch % dp:
            return None
        lb = global_batch // dp
    else:
        lb = local_batch or max(1, pp)
    if pp > 1 and lb % pp:
        return None
    return lb


def _layout_config(
    model: str, seq: int, lb: int, degrees: dict, gpus: int, ac: tuple, compile_: bool, float8: bool, stack: Stack
):
    """The dry-run config of a layout with an AC mode (`(mode, selective option)`), as the software
    of `stack` configures it by default."""
    from core.dryrun.stack import config_settings

    cfg = base_config(model, seq, lb, config_settings(dataclasses.asdict(stack)))
    p = cfg.parallelism
    p.dp_shard, p.tp, p.pp, p.cp, p.world_size = degrees["dp_shard"], degrees["tp"], degrees["pp"], degrees["cp"], gpus
    p.pp_schedule, p.pp_microbatches = "1F1B", (degrees["pp"] if degrees["pp"] > 1 else 0)
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option = ac
    cfg.activation_checkpoint.save_every_other_mm = True
    cfg.compile.enabled = compile_
    cfg.float8.enabled = float8
    cfg.float8.enable_fsdp_float8_all_gather = float8  # as --float8's help says
    return cfg


def _cheapest_ac(
    model: str,
    seq: int,
    lb: int,
    degrees: dict,
    gpus: int,
    gpu_mem: float,
    compile_,
    float8,
    fits_only: bool,
    gpu_name: str,
    stack: Stack,
):
    """The layout with the cheapest AC mode that fits (or full AC when none does); None when the
    layout itself is invalid (or, `fits_only`, when even full AC does not fit: tried first then,
    as it needs the least memory). Fits: the estimate plus the memory accounting's band for its
    kind on `gpu_name` (core/dryrun/accuracy.py memory_band) is within `gpu_mem`; one that fits
    only without its band is refused and marked near_limit. `stack`: what the software that runs
    it does differently (core/dryrun/stack.py)."""
    from core.config import ConfigError
    from core.dryrun import accuracy
    from core.dryrun.memory import allocator_gap, estimate_memory
    from core.validate import validate

    def at(ac) -> Candidate | None:
        cfg = _layout_config(model, seq, lb, degrees, gpus, ac, compile_, float8, stack)
        try:
            validate(cfg, check_files=False)
        except ConfigError:
            return None  # the layout itself is invalid: no AC mode helps
        est = estimate_memory(cfg, gpu_gib=gpu_mem, stack=stack)
        # Uncapped: a plan needs the allocator's usual slack, not its retry path.
        need = est["allocated_peak_gib"] + allocator_gap(est["allocated_peak_gib"])
        mae = accuracy.memory_band(accuracy.kind_of(cfg, gpu_name))["mae"]
        band = mae / 100 if mae is not None else None
        with_band = need * (1 + (band or 0.0))
        c = Candidate(dict(degrees), ac[0], lb, need, with_band <= gpu_mem, [], cfg, est, memory_band=band)
        c.near_limit = need <= gpu_mem < with_band
        return c

    full = at(AC_ORDER[-1]) if fits_only else None
    if fits_only and (full is None or not full.fits):
        return None
    best = None
    for ac in AC_ORDER[:-1] if fits_only else AC_ORDER:
        c = at(ac)
        if c is None:
            return best
        best = c
        if best.fits:
            return best
    return full or best


def _by_speed(ranked: list[Candidate], gpu: str | GPUSpec | None, stack: Stack) -> list[Candidate]:
    """Rank the candidates by predicted tokens/s per GPU; the guidance still outranks speed.
    Each carries its band, the model's error over public figures of its kind (core/dryrun/
    accuracy.py): predictions within their band of the fastest are a tie the model cannot
    break, ordered by the rules (SPEED_TIE before any validation)."""
    from core.dryrun import accuracy
    from core.dryrun.gpuspec import GPUSpec, load_spec
    from core.dryrun.runtime import predict

    if not ranked:
        return []
    spec = gpu if isinstance(gpu, GPUSpec) else load_spec(gpu or DEFAULT_GPU)
    judged = (accuracy.band() or {}).get("judged", [])
    for c in ranked:
        c.predicted = predict(c.cfg, spec, memory=c.memory, stack=stack)
        mae = accuracy.kind_band(accuracy.kind_of(c.cfg, spec.name), judged)["mae"] if judged else None
        c.band = mae / 100 if mae is not None else None
    # The guidance still outranks speed: a layout against it (e.g. CP at short sequences) comes after.
    ranked = sorted(ranked, key=lambda c: (not c.fits, bool(c.violations), -c.tps if c.fits else 0.0))
    top = ranked[0]

    def within(c: Candidate) -> bool:
        band = max(b for b in (top.band, c.band, SPEED_TIE) if b is not None) if top.band else SPEED_TIE
        return c.fits == top.fits and bool(c.violations) == bool(top.violations) and c.tps >= top.tps * (1 - band)

    ties = [c for c in ranked if within(c)]
    ties.sort(key=Candidate.key)
    return ties + [c for c in ranked if c not in ties]


def candidates(
    model: str,
    gpus: int,
    seq: int,
    gpu_mem: float,
    local_batch: int | None = None,
    gpus_per_node: int = 8,
    compile_: bool = True,
    float8: bool = False,
    global_batch: int | None = None,
    by_speed: bool = False,
    gpu: str | GPUSpec | None = None,
    best_only: bool = False,
    software: Software | None = None,
) -> list[Candidate]:
    """Every valid (dp_shard, tp, pp, cp) layout of `gpus` GPUs with the cheapest AC that fits
    (or full AC when none does), ranked (best first). The batch: `local_batch` sequences per
    data-parallel rank, or `global_batch` split over the data-parallel ranks, or else 1 per rank
    (one per stage with PP). by_speed: rank the ones that fit by predicted tokens/s per GPU on
    the GPU spec `gpu` (a name, or a loaded spec; default: the paper's), the rules breaking ties.
    best_only: only the layouts that fit and follow the guidance (with by_speed, the same first
    one whenever there is one; empty when there is none). `software`: what the estimates and
    predictions speak for (core/dryrun/software.py; None: this trainer at its pinned versions)."""
    from core.dryrun.software import PINNED
    from core.models.llama3 import FLAVORS

    stack = (software or PINNED).stack()
    gpu_name = _spec_name(gpu)
    out = []
    for dp, tp, pp, cp in _layouts(gpus, gpus_per_node, FLAVORS[model].n_layers):
        lb = _local_batch(dp, pp, local_batch, global_batch)
        degrees = {"dp_shard": dp, "tp": tp, "pp": pp, "cp": cp}
        violations = _violations(degrees, seq, gpus_per_node)
        if lb is None or (best_only and violations):
            continue
        best = _cheapest_ac(model, seq, lb, degrees, gpus, gpu_mem, compile_, float8, best_only, gpu_name, stack)
        if best is not None and (best.fits or not best_only):
            best.violations = violations
            out.append(best)
    ranked = sorted(out, key=Candidate.key)
    return _by_speed(ranked, gpu, stack) if by_speed else ranked


def _spec_name(gpu) -> str:
    """The name of the GPU spec a plan sizes for (a name, a loaded spec, a spec file, or None)."""
    from core.dryrun.gpuspec import GPUSpec, load_spec

    if isinstance(gpu, GPUSpec):
        return gpu.name
    return load_spec(gpu).name if gpu else DEFAULT_GPU


def _violations(d: dict, seq: int, gpus_per_node: int) -> list[str]:
    v = []
    fsdp_group = d["dp_shard"] * d["cp"]
    if fsdp_group > FSDP_MAX_GROUP:
        v.append(
            f"FSDP group of {fsdp_group} ranks > {FSDP_MAX_GROUP}: latency-bound collectives, add TP within the node"
        )
    if d["cp"] > 1 and seq < LONG_CONTEXT:
        v.append(f"CP at {seq} tokens: context parallel is for long sequences (>= {LONG_CONTEXT})")
    if d["tp"] > 1 and d["tp"] * d["cp"] > gpus_per_node:
        v.append("TP x CP spans nodes")
    return v


@click.command("plan")
@click.option("--model", type=click.Choice(["8B", "70B", "405B"]), required=True)
@click.option(
    "--gpus", type=int, default=None, help="World size (without it: --tokens and --days, the GPU count found)."
)
@click.option(
    "--tokens",
    type=TOKENS,
    default=None,
    help="Token budget to train on (2T, 500B, 1.5e12): with --days, the smallest GPU count that finishes in time.",
)
@click.option("--days", type=DAYS, default=None, help="Days the token budget must take at most (with --tokens).")
@click.option("--seq", type=int, default=8192, show_default=True, help="Sequence length.")
@click.option(
    "--gpu-mem", type=float, default=None, help="GiB per GPU (default: the --gpu spec's capacity, 80 without --gpu)."
)
@click.option(
    "--gpu",
    default=None,
    metavar="NAME|FILE",
    help="GPU spec of the speed prediction: a name of core/dryrun/hardware/ or a spec file "
    "(`run-recipe gpu-spec --measure` writes one); default: the paper's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.option(
    "--local-batch",
    type=int,
    default=None,
    help="Sequences per data-parallel rank (default: 1, or one per stage with PP).",
)
@click.option(
    "--global-batch",
    type=int,
    default=None,
    help="Sequences per step, split over the data-parallel ranks of each layout (instead of --local-batch).",
)
@click.option("--gpus-per-node", type=int, default=8, show_default=True)
@click.option("--top", type=int, default=10, show_default=True, help="Candidates to print.")
@click.option("--no-compile", is_flag=True, help="Estimate eager memory (default: per-block compile).")
@click.option("--float8", is_flag=True, help="Float8 linears with float8 FSDP all-gather.")
@text_option(
    "--software",
    "KEY=VALUE,...",
    "The software the estimates and predictions speak for, e.g. date=2025-03,torch=2.7.0 (a torchtitan stack; "
    "default: this trainer at the pinned versions). Keys: date, trainer, torch, torchao, torchtitan, cuda, "
    "rocm, cudnn, nccl.",
)
def plan(
    model,
    gpus,
    tokens,
    days,
    seq,
    gpu_mem,
    gpu,
    as_json,
    local_batch,
    global_batch,
    gpus_per_node,
    top,
    no_compile,
    float8,
    software,
):
    """Propose FSDP/TP/PP/CP degrees for MODEL on GPUS GPUs: the layouts that fit (dry-run memory
    estimate) ranked by predicted tokens/s per GPU (dry-run performance model). Without --gpus,
    with --tokens and --days: the smallest GPU count (whole nodes) and layout predicted to train
    on the tokens in time (recipes/plan/budget.py)."""
    from core.dryrun.accuracy import text as band_text
    from core.dryrun.gpuspec import DEFAULT_GPU, SpecError, load_spec

    try:
        spec = load_spec(gpu or DEFAULT_GPU)
    except SpecError as e:
        raise click.BadParameter(str(e), param_hint="--gpu") from None
    gpu_mem, memory = gpu_memory(gpu_mem, gpu, spec)
    software = _software(software)
    _check_plan_inputs(model, gpus, seq, gpu_mem, local_batch, global_batch)
    _check_plan_options(model, gpus, tokens, days, as_json, global_batch, gpus_per_node, top)
    if local_batch and global_batch:
        raise click.BadParameter("give --local-batch or --global-batch, not both")
    setup = Setup(model, seq, gpu_mem, local_batch, global_batch, gpus_per_node, not no_compile, float8, spec, software)
    if gpus is None:
        from recipes.plan.budget import budget_command

        if tokens is None or days is None:
            raise click.UsageError("give --gpus, or --tokens and --days (the GPU count is then found)")
        budget_command(setup, tokens, days, as_json, best_at, memory)
        return
    ranked = candidates(
        model,
        gpus,
        seq,
        gpu_mem,
        local_batch,
        gpus_per_node,
        not no_compile,
        float8,
        global_batch,
        by_speed=True,
        gpu=spec,
        software=software,
    )
    if not ranked:
        raise click.ClickException("no valid layout (degrees must divide the GPUs and the model's heads)")
    if as_json:
        click.echo(ranked_json(ranked, spec.name, software_of(setup).text()))
        return
    click.echo(
        f"Llama 3.1 {model} on {gpus} GPUs ({gpus_per_node} per node), seq {seq}; estimated peak "
        f"reserved per GPU (core.dryrun.memory), predicted tokens/s per GPU on {spec.name} "
        f"(core.dryrun.runtime), error band {band_text(gpu=spec.name)}; ranked by speed among those that fit."
    )
    click.echo(f"Software: the predictions speak for {software_of(setup).text()}")
    click.echo(f"Memory per GPU: {memory}")
    click.echo(ranked_table(ranked[:top], gpu_mem))
    best = ranked[0]
    click.echo(
        f"\nproposed: {best.layout()}, AC {best.ac}, local batch {best.local_batch}"
        + ("" if best.fits else "  (nothing fits: the least memory is shown)")
    )
    if tokens is not None and best.fits:
        took = tokens / (best.tps * gpus) / SECONDS_PER_DAY
        in_days = days_text(took, days) if days else f"{took:.1f}"
        click.echo(f"{tokens:.3g} tokens at {rate_text(best.tps * gpus)} tokens/s: {in_days} days predicted")
    for line in against_the_paper(ranked, model, gpus, seq):
        click.echo(line)


def _software(text: str | None) -> Software | None:
    """--software's stack (core/dryrun/software.py parse); a bad one is refused before any estimate."""
    from core.dryrun.software import parse

    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--software") from None


def gpu_memory(gpu_mem: float | None, gpu: str | None, spec: GPUSpec) -> tuple[float, str]:
    """The GiB per GPU a plan sizes its layouts with, and a line saying so and where it comes from."""
    if gpu_mem is not None:
        return gpu_mem, f"{gpu_mem:g} GiB (--gpu-mem)"
    if gpu:
        return spec.hbm_capacity_gib, f"{spec.hbm_capacity_gib:g} GiB, {spec.name}'s capacity (--gpu)"
    return DEFAULT_GPU_MEM, (
        f"{DEFAULT_GPU_MEM:g} GiB, the default without --gpu (an 80 GB H100's); {spec.name}, the spec the "
        f"speeds are predicted on, holds {spec.hbm_capacity_gib:g} GiB: --gpu-mem "
        f"{spec.hbm_capacity_gib:g} sizes with that"
    )


def best_at(setup: Setup, gpus: int) -> Candidate | None:
    """The first layout `plan --gpus` proposes at a GPU count when one fits and follows the
    guidance (None otherwise: a count whose only fits break a rule does not count)."""
    s = setup
    ranked = candidates(
        s.model,
        gpus,
        s.seq,
        s.gpu_mem,
        s.local_batch,
        s.gpus_per_node,
        s.compile_,
        s.float8,
        s.global_batch,
        by_speed=True,
        gpu=s.spec,
        best_only=True,
        software=s.software,
    )
    return ranked[0] if ranked else None


def _check_plan_inputs(model: str, gpus: int | None, seq: int, gpu_mem: float, local_batch, global_batch) -> None:
    """Each bound as it is, named by its option (click.BadParameter)."""
    from core.models.llama3 import FLAVORS

    if gpus is not None and gpus < 1:
        raise click.BadParameter(f"{gpus}: at least 1 GPU", param_hint="--gpus")
    if seq < 2:
        raise click.BadParameter(f"{seq}: at least 2 tokens (a token and the next one it predicts)", param_hint="--seq")
    context = FLAVORS[model].max_seq_len
    if seq > context:
        raise click.BadParameter(
            f"{seq:,} tokens is beyond Llama 3.1 {model}'s context length of {context:,}", param_hint="--seq"
        )
    if not math.isfinite(gpu_mem) or gpu_mem <= 0:  # nan compares False with everything
        raise click.BadParameter(f"{gpu_mem:g}: GiB per GPU must be above 0 and finite", param_hint="--gpu-mem")
    for name, b in (("--local-batch", local_batch), ("--global-batch", global_batch)):
        if b is not None and b < 1:
            raise click.BadParameter(f"{b}: at least 1 sequence", param_hint=name)


def _check_plan_options(model: str, gpus, tokens, days, as_json: bool, global_batch, gpus_per_node: int, top: int):
    """Options that would be ignored, or leave no layout to rank (click.BadParameter, exit 2)."""
    from core.models.llama3 import FLAVORS

    if gpus_per_node < 1:
        raise click.BadParameter(f"{gpus_per_node}: at least 1 GPU per node", param_hint="--gpus-per-node")
    if top < 1:
        raise click.BadParameter(f"{top}: at least 1 candidate", param_hint="--top")
    if gpus is not None and days is not None:  # the count is given: there is nothing to search
        raise click.BadParameter(
            "--days is the deadline of the GPU count's search: give --gpus, or --tokens and --days", param_hint="--days"
        )
    if gpus is not None and tokens is not None and as_json:
        raise click.BadParameter("with --gpus, --tokens only adds the days to the text answer", param_hint="--tokens")
    if gpus is None or not global_batch:
        return
    layouts = _layouts(gpus, gpus_per_node, FLAVORS[model].n_layers)
    if not any(_local_batch(dp, pp, None, global_batch) for dp, _, pp, _ in layouts):
        raise click.BadParameter(
            f"{global_batch} sequences split over the data-parallel ranks of no layout of {gpus} GPUs (their "
            "count must divide it, and each rank's share must divide by its pipeline stages)",
            param_hint="--global-batch",
        )
