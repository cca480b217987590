"""Pipeline stage arithmetic without torch: schedule names and kinds, stages per rank,
microbatches, the layer split, the stage-to-rank placement, the tensors between stages
(`parallelism.pp_static_shapes`) and the checks on them.

The config's validation, the pipeline builder and the dry-run's memory accounting all read
these, so a layout is split the same way everywhere and the dry-run needs no torch for it.
Arguments are the config's dataclasses (`Parallelism`, `JobConfig`), read by attribute.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from core.errors import ConfigError

if TYPE_CHECKING:  # type names only: core.config imports this module
    from core.config import JobConfig, Parallelism

# The schedules `torch.distributed.pipelining.schedules.get_schedule_class` takes
# (tests/test_pipeline.py checks the list against the installed torch).
PPSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
PP_SCHEDULES: tuple[str, ...] = typing.get_args(PPSchedule)
PP_SCHEDULES_SINGLE = ("GPipe", "1F1B")  # one stage per rank
PP_SCHEDULES_LOOPED = tuple(s for s in PP_SCHEDULES if s not in PP_SCHEDULES_SINGLE)  # >= 2 per rank
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # exactly 2 per rank; stage s and 2 pp - 1 - s share a rank
# Backward split into input- and weight-gradient parts (torch runs them uncompiled only).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Run microbatches // pp rounds, which must divide the microbatch count.
ROUND_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


def default_stages_per_rank(schedule: str) -> int:
    return 1 if schedule in PP_SCHEDULES_SINGLE else 2


def stages_per_rank(p: Parallelism, n_layers: int | None = None) -> int:
    """Explicit, else from split points or layers per stage (needs n_layers), else 1 or 2."""
    if p.pp == 1:
        return 1
    if p.pp_stages_per_rank:
        return p.pp_stages_per_rank
    n_stages = 0
    if p.pp_split_points:
        n_stages = len(p.pp_split_points) + 1
    elif p.pp_layers_per_stage and n_layers:
        n_stages = -(-n_layers // p.pp_layers_per_stage)
    if n_stages:
        return max(1, n_stages // p.pp)  # check_pipeline refuses a count pp does not divide
    return default_stages_per_rank(p.pp_schedule)


def pp_microbatches(p: Parallelism, n_layers: int | None = None) -> int:
    """Explicit, else one per stage (torchtitan's default)."""
    return p.pp_microbatches or p.pp * stages_per_rank(p, n_layers)


def split_layers(
    n_layers: int, n_stages: int, layers_per_stage: int = 0, split_points: Sequence[int] = ()
) -> list[list[int]]:
    """Layer indices of each stage. Raises ConfigError naming the key when it cannot be done.

    - split_points: the first layer of stages 1 .. n-1 (strictly increasing);
    - layers_per_stage L: every stage holds L layers except the last and first, which give up
      the shortfall n_stages * L - n_layers (they also carry the output / the embedding);
    - otherwise evenly, the remainder going to the middle stages first.
    Every stage holds at least one layer.
    """
    if n_stages > n_layers:
        raise ConfigError(f"parallelism.pp: {n_stages} pipeline stages exceed the model's {n_layers} layers")
    if split_points:
        pts = list(split_points)
        if len(pts) != n_stages - 1:
            raise ConfigError(
                f"parallelism.pp_split_points: {len(pts)} split points for {n_stages} stages (need {n_stages - 1})"
            )
        bounds = [0, *pts, n_layers]
        if any(b >= e for b, e in itertools.pairwise(bounds)):
            raise ConfigError(f"parallelism.pp_split_points: {pts} must increase strictly within 1..{n_layers - 1}")
        return [list(range(b, e)) for b, e in itertools.pairwise(bounds)]
    if layers_per_stage:
        short = n_stages * layers_per_stage - n_layers
        last_short, first_short = (short + 1) // 2, short // 2
        if short < 0 or max(last_short, first_short) >= layers_per_stage:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage: {layers_per_stage} layers x {n_stages} stages cannot "
                f"hold {n_layers} layers with at least one layer on every stage"
            )
        sizes = [layers_per_stage] * n_stages
        sizes[-1] -= last_short
        sizes[0] -= first_short
    else:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base] * n_stages
        order = list(range(1, n_stages - 1)) + [0, n_stages - 1]  # middle stages first
        for i in order[:extra]:
            sizes[i] += 1
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def num_stages(cfg: JobConfig, n_layers: int) -> int:
    return cfg.parallelism.pp * stages_per_rank(cfg.parallelism, n_layers)


def plan_stages(cfg: JobConfig, n_layers: int) -> list[list[int]]:
    p = cfg.parallelism
    return split_layers(n_layers, num_stages(cfg, n_layers), p.pp_layers_per_stage, p.pp_split_points)


def stage_ids_for_rank(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """The stages a pp rank holds, as torch's schedules place them: round-robin ("loop": rank r
    holds r, r + pp, ...) or, for the V schedules, down and back up (rank r holds r and
    2 pp - 1 - r). Same mapping as torch's `generate_rank_to_stage_mapping`."""
    if schedule not in V_SCHEDULES:
        return [s for s in range(n_stages) if s % pp == pp_rank]
    if n_stages % pp:
        raise ValueError(f"num_stages {n_stages} must be evenly divisible by pp_size {pp} for V schedules")
    return [s for s in range(n_stages) if (s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp) == pp_rank]


def check_pipeline(cfg: JobConfig, n_layers: int) -> None:
    """Stage count and layer split, and the microbatch counts each torch schedule accepts."""
    t, p = cfg.training, cfg.parallelism
    spr = stages_per_rank(p, n_layers)
    if p.pp_split_points and (len(p.pp_split_points) + 1) % p.pp:
        raise ConfigError(
            f"parallelism.pp_split_points: {len(p.pp_split_points) + 1} stages do not divide over pp {p.pp} ranks"
        )
    if (
        p.pp_layers_per_stage
        and not p.pp_split_points
        and not p.pp_stages_per_rank
        and -(-n_layers // p.pp_layers_per_stage) % p.pp
    ):
        raise ConfigError(
            f"parallelism.pp_layers_per_stage: {p.pp_layers_per_stage} gives "
            f"{-(-n_layers // p.pp_layers_per_stage)} stages for {n_layers} layers, not a "
            f"multiple of pp {p.pp}"
        )
    # the key that set the stage count, named in the errors below
    src = "parallelism." + (
        "pp_stages_per_rank"
        if p.pp_stages_per_rank
        else "pp_split_points"
        if p.pp_split_points
        else "pp_layers_per_stage"
        if p.pp_layers_per_stage
        else "pp_stages_per_rank"
    )
    if p.pp_schedule in V_SCHEDULES and spr != 2:
        raise ConfigError(f"{src}: {p.pp_schedule} needs exactly 2 stages per rank, got {spr}")
    if p.pp_schedule in PP_SCHEDULES_SINGLE and spr != 1:
        raise ConfigError(f"{src}: {p.pp_schedule} takes 1 stage per rank, got {spr}")
    if p.pp_schedule in PP_SCHEDULES_LOOPED and spr < 2:
        raise ConfigError(f"{src}: {p.pp_schedule} loops over >= 2 stages per rank, got {spr}")
    n_stages = p.pp * spr
    if n_stages > n_layers:
        raise ConfigError(
            f"parallelism.pp: {n_stages} pipeline stages (pp {p.pp} x {spr} per rank) "
            f"exceed the model's {n_layers} layers ({cfg.model.flavor})"
        )
    split_layers(n_layers, n_stages, p.pp_layers_per_stage, p.pp_split_points)
    micro = pp_microbatches(p, n_layers)
    if micro < p.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches: {micro} microbatches cannot fill a {p.pp}-rank pipeline (need >= {p.pp})"
        )
    if p.pp_schedule == "DualPipeV" and micro < n_stages:
        raise ConfigError(f"parallelism.pp_microbatches: DualPipeV needs >= one per stage ({n_stages}), got {micro}")
    rounds = max(1, micro // p.pp)  # torch's interleaved schedules run micro // pp rounds
    if p.pp_schedule in ROUND_SCHEDULES and micro % rounds:
        raise ConfigError(
            f"parallelism.pp_microbatches: {p.pp_schedule} needs a multiple of "
            f"{rounds} rounds (microbatches // pp), got {micro}"
        )
    if t.local_batch_size % micro:
        raise ConfigError(
            f"parallelism.pp_microbatches: {micro} does not divide training.local_batch_size {t.local_batch_size}"
        )
    if cfg.compile.enabled and p.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(
            f"compile.enabled: torch's {p.pp_schedule} splits the backward into input and "
            "weight parts, which it does not support on compiled stages"
        )


# --------------------------------------------------------------------------------- static shapes
class StageShapes(NamedTuple):
    """What crosses a stage boundary for one microbatch on one rank (local shards): the shapes
    `parallelism.pp_static_shapes` gives each PipelineStage instead of inferring them."""

    tokens: tuple[int, int]  # the first stage's input: (microbatch, seq / cp) token ids
    hidden: tuple[int, int, int]  # between stages: (microbatch, seq / (cp x tp), dim), sequence parallel
    logits: tuple[int, int, int]  # the last stage's output, whole: (microbatch, seq / cp, vocab)
    vocab_shards: int  # tp when loss parallel keeps the logits vocabulary-sharded (a DTensor), else 1


def static_stage_shapes(cfg: JobConfig, n_layers: int, dim: int, vocab: int) -> StageShapes:
    """The shapes from the config: CP shards the sequence of the tokens (the step shards the batch
    before the schedule splits it), TP's sequence parallelism the hidden states between blocks,
    loss parallel the logits' vocabulary. The batch, sequence and hidden-state splits divide evenly
    once validated (check_pipeline, core.validate); a vocabulary loss parallel cannot split evenly
    is ConfigError naming the key: shards would differ in shape between ranks, which one example
    per stage cannot describe."""
    t, p = cfg.training, cfg.parallelism
    key = "parallelism.pp_static_shapes"
    micro = pp_microbatches(p, n_layers)
    shards = p.tp if p.tp > 1 and p.loss_parallel else 1
    if vocab % shards:
        raise ConfigError(
            f"{key}: the vocabulary ({vocab} tokens) over tp {p.tp} (loss parallel) does not divide evenly, so "
            f"shards differ in shape between ranks and one example per stage cannot describe them (set {key} = false)"
        )
    mb, seq = t.local_batch_size // micro, t.seq_len // p.cp
    return StageShapes((mb, seq), (mb, seq // p.tp, dim), (mb, seq, vocab), shards)
