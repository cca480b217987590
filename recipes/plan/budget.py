"""`run-recipe plan --model M --tokens N --days D`: the smallest GPU count (whole nodes) and the
layout predicted to train on N tokens within D days, with the predicted days, GPU-hours and the
performance model's error band.

At a GPU count, the layout is `run-recipe plan --gpus` 's first one (recipes/plan/layouts.py: the layouts
that fit and follow the paper's guidance, ranked by predicted tokens/s per GPU), and its days are
N / (its tokens/s per GPU x the count). A count where only layouts against the guidance fit (an
FSDP group of thousands: its all-gathers latency-bound, its global batch grown with it) does not
count. The search over node counts, up to MAX_GPUS:

1. two bounds no count below can beat: memory (the fp32 weights, gradients and AdamW's two states,
   16 bytes per parameter, sharded over every GPU, must fit) and time (`fastest_tokens_per_gpu`:
   the model's matmul and attention FLOPs at the spec's fastest rates, nothing else); counts
   below them are not evaluated;
2. doubling the node count from there until one finishes in time (the first power of two that
   does), then bisecting between it and its half.

The answer is monotone in the budget (more days never needs more GPUs): a larger budget passes
every count a smaller one passes, so the doubling stops no later and each bisection step goes
the same way or lower. The layout found at a count is cached for the process (another budget,
--json, the tests reuse it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from recipes.plan.report import days_text, rate_json, rate_text

if TYPE_CHECKING:  # type names only
    from core.dryrun.gpuspec import GPUSpec
    from core.dryrun.software import Software
    from recipes.plan.candidate import Candidate

MAX_GPUS = 16384
SECONDS_PER_DAY = 86400
STATE_BYTES_PER_PARAM = 16  # fp32 weight, gradient, AdamW's two states (core/dryrun/memory.py)
SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


class TokenCount(click.ParamType):
    """A positive token count: a number, or one with a suffix K, M, B (G), T (2T, 500B, 1.5e12)."""

    name = "tokens"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMBGT]?)\s*", str(value), re.IGNORECASE)
            try:
                number = float(match.group(1)) * SUFFIXES[match.group(2).upper()] if match else math.nan
            except ValueError:
                number = math.nan
        if math.isnan(number):
            self.fail(
                f"{value!r} is not a token count (a number, or one with a suffix K, M, B, T: 2T, 500B)", param, ctx
            )
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r}: a token budget must be a positive, finite count", param, ctx)
        return number


class Days(click.ParamType):
    """A positive, finite number of days."""

    name = "days"

    def convert(self, value, param, ctx):
        try:
            days = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of days", param, ctx)
        if not math.isfinite(days) or days <= 0:
            self.fail(f"{value!r}: the days must be above 0 and finite", param, ctx)
        return days


TOKENS, DAYS = TokenCount(), Days()


@dataclass(frozen=True)
class Setup:
    """What a plan is asked for besides the GPU count (hashable: the cache's key)."""

    model: str
    seq: int
    gpu_mem: float
    local_batch: int | None
    global_batch: int | None
    gpus_per_node: int
    compile_: bool
    float8: bool
    spec: GPUSpec
    software: Software | None = None  # what the predictions speak for (None: this trainer, pinned)


@dataclass
class AtCount:
    """The best layout at a GPU count (None: nothing fits) and its predicted days."""

    gpus: int
    best: Candidate | None
    days: float | None


@dataclass
class Answer:
    tokens: float
    days: float
    found: AtCount | None  # the smallest count that finishes in time
    tried: list[AtCount]  # every count evaluated, ascending
    why_not: str = ""  # when nothing finishes: memory, or the time at the largest count tried


_BEST: dict[tuple[Setup, int], Candidate | None] = {}


def fastest_tokens_per_gpu(setup: Setup) -> float:
    """Tokens/s per GPU no layout of the model can beat on the spec: every GEMM at the spec's
    fastest tile rate (core/dryrun/gemm.py: its rates never fall as a GEMM grows, so the largest
    one's is the ceiling), 6 FLOPs per parameter and token (forward and backward; embedding
    lookups are not GEMMs), and causal attention's FLOPs at the faster attention rate; nothing
    else (recompute, memory-bound work, communication, bubbles) counted."""
    from core.dryrun.gemm import tile_rate
    from core.dryrun.runtime import FLASH_BWD_OVER_FWD
    from core.models.args import get_args, param_count

    a, s = get_args(setup.model), setup.spec
    gemm_rate = max(tile_rate(s, kind, math.inf) for kind, _ in s.gemm)
    attn_rate = s.peak_bf16_flops * max(s.flash_attention_fwd, s.flash_attention_bwd) * s.clock_fraction
    gemm_flops = 6 * param_count(a, exclude_embedding=True)
    attn_flops = (1 + FLASH_BWD_OVER_FWD) * 2 * setup.seq * a.n_heads * a.head_dim * a.n_layers
    return 1 / (gemm_flops / gemm_rate + attn_flops / attn_rate)


def lower_bounds(setup: Setup, tokens: float, days: float) -> tuple[int, int]:
    """(GPUs the training state needs, GPUs the fastest possible layout needs for the budget)."""
    from core.models.args import param_count

    memory = math.ceil(STATE_BYTES_PER_PARAM * param_count(setup.model) / (setup.gpu_mem * 2**30))
    return memory, math.ceil(tokens / (days * SECONDS_PER_DAY * fastest_tokens_per_gpu(setup)))


class Search:
    """The counts evaluated for one setup and token budget; `at(nodes)` evaluates (cached)."""

    def __init__(self, setup: Setup, tokens: float, best_at: Callable[[Setup, int], Candidate | None]):
        self.setup, self.tokens, self.best_at = setup, tokens, best_at
        self.tried: dict[int, AtCount] = {}

    def at(self, nodes: int) -> AtCount:
        gpus = nodes * self.setup.gpus_per_node
        if gpus not in self.tried:
            key = (self.setup, gpus)
            if key not in _BEST:
                _BEST[key] = self.best_at(self.setup, gpus)
            best = _BEST[key]
            days = self.tokens / (best.tps * gpus) / SECONDS_PER_DAY if best is not None else None
            self.tried[gpus] = AtCount(gpus, best, days)
        return self.tried[gpus]


def search(setup: Setup, tokens: float, days: float, best_at: Callable[[Setup, int], Candidate | None]) -> Answer:
    """The smallest node count whose best layout finishes `tokens` within `days` (see the module's
    docstring); `best_at(setup, gpus)`: plan's first layout at that count, None when none fits."""
    gpn = setup.gpus_per_node
    max_nodes = MAX_GPUS // gpn
    memory, time_bound = lower_bounds(setup, tokens, days)
    bound = math.ceil(max(memory, time_bound) / gpn)  # in nodes: every count below fails
    s = Search(setup, tokens, best_at)

    def ok(nodes: int) -> bool:
        if nodes < bound:
            return False
        r = s.at(nodes)
        return r.days is not None and r.days <= days

    lo, hi = 0, 1
    while hi <= max_nodes and not ok(hi):
        lo, hi = hi, hi * 2
    if hi > max_nodes:
        if lo < max_nodes and ok(max_nodes):
            hi = max_nodes
        else:
            return Answer(
                tokens, days, None, sorted(s.tried.values(), key=lambda r: r.gpus), _why_not(s, memory, bound, days)
            )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return Answer(tokens, days, s.at(hi), sorted(s.tried.values(), key=lambda r: r.gpus))


def _why_not(s: Search, memory_bound: int, bound_nodes: int, budget_days: float) -> str:
    largest = max(s.tried.values(), key=lambda r: r.gpus, default=None)
    state = f"{s.setup.model}'s weights, gradients and AdamW states ({STATE_BYTES_PER_PARAM} bytes per parameter)"
    if memory_bound > MAX_GPUS:
        return f"memory: {state} need {memory_bound:,} GPUs of {s.setup.gpu_mem:g} GiB, beyond {MAX_GPUS:,}"
    if largest is None:
        return (
            f"time: even with every matmul at the spec's fastest rate and nothing else, the budget needs "
            f"{bound_nodes * s.setup.gpus_per_node:,} GPUs, beyond {MAX_GPUS:,}"
        )
    if largest.best is None:
        return (
            f"memory: no layout that follows the guidance fits {s.setup.gpu_mem:g} GiB per GPU at "
            f"{largest.gpus:,} GPUs (the largest tried)"
        )
    return (
        f"time: at {largest.gpus:,} GPUs (the largest tried) the fastest layout, {largest.best.layout()}, "
        f"needs {days_text(largest.days, budget_days)} days"
    )


def _band(gpu: str) -> tuple[str, float | None]:
    """The model's error band on this GPU system as text, and the days' range it implies: the
    system's own mean error, else the overall one (None before a validation)."""
    from core.dryrun import accuracy

    b = accuracy.band()
    own = accuracy.gpu_error(gpu)
    return accuracy.text(gpu=gpu), (own if own is not None else b["mean_abs_error_pct"] / 100 if b else None)


def software_of(setup: Setup) -> Software:
    """The software a plan's predictions speak for: --software's, else this trainer's pinned."""
    from core.dryrun.software import PINNED

    return setup.software or PINNED


def answer_json(setup: Setup, a: Answer, took_s: float) -> dict:
    out: dict = {
        "model": setup.model,
        "tokens": a.tokens,
        "days_budget": a.days,
        "gpu": setup.spec.name,
        "gpus_per_node": setup.gpus_per_node,
        "seq": setup.seq,
        "finishes": a.found is not None,
        "why_not": a.why_not or None,
        "searched": [{"gpus": r.gpus, "fits": r.best is not None, "days": r.days} for r in a.tried],
        "error_band": _band(setup.spec.name)[0],
        "software": software_of(setup).text(),
        "search_s": round(took_s, 2),
    }
    if a.found is not None and a.found.best is not None and a.found.days is not None:
        c, n = a.found.best, a.found.gpus
        out.update(
            gpus=n,
            nodes=n // setup.gpus_per_node,
            layout=c.layout(),
            degrees=c.degrees,
            ac=c.ac,
            local_batch=c.local_batch,
            global_batch_tokens=c.local_batch * c.degrees["dp_shard"] * setup.seq,
            estimate_gib=round(c.estimate_gib, 2),
            tokens_per_sec_per_gpu=rate_json(c.tps),
            mfu=round(c.predicted["mfu"], 4) if c.predicted else None,
            predicted_days=round(a.found.days, 2),
            gpu_hours=round(a.found.days * 24 * n),
        )
    return out


def budget_command(
    setup: Setup,
    tokens: float,
    days: float,
    as_json: bool,
    best_at: Callable[[Setup, int], Candidate | None],
    memory: str = "",
) -> None:
    """Search and print the answer (text or JSON); exit 1 when nothing finishes in time. `memory`:
    the line saying the GiB per GPU the layouts are sized with and where it comes from."""
    import json
    import sys
    import time

    t0 = time.perf_counter()
    a = search(setup, tokens, days, best_at)
    took = time.perf_counter() - t0
    done = a.found is not None and a.found.best is not None and a.found.days is not None
    if as_json:  # the exit code of the text answer
        click.echo(json.dumps(answer_json(setup, a, took), indent=2))
        sys.exit(0 if done else 1)
    band, frac = _band(setup.spec.name)
    click.echo(
        f"Llama 3.1 {setup.model}, {tokens:.4g} tokens in at most {days:g} days on {setup.spec.name} "
        f"({setup.gpus_per_node} per node), seq {setup.seq}; searched in {took:.1f} s."
    )
    click.echo(f"Software: the predictions speak for {software_of(setup).text()}")
    click.echo(f"Memory per GPU: {memory or f'{setup.gpu_mem:g} GiB'}")
    for r in a.tried:
        what = (
            f"{r.best.layout()}, {days_text(r.days, days)} days"
            if r.best is not None and r.days is not None
            else "no layout fits and follows the guidance"
        )
        click.echo(f"  {r.gpus:>6,} GPUs: {what}")
    if not done:
        click.echo(f"nothing finishes in {days:g} days up to {MAX_GPUS:,} GPUs: {a.why_not}")
        sys.exit(1)
    c, n, d = a.found.best, a.found.gpus, a.found.days
    batch = c.local_batch * c.degrees["dp_shard"]
    click.echo(
        f"\nanswer: {n:,} GPUs ({n // setup.gpus_per_node:,} nodes): {c.layout()}, AC {c.ac}, local batch "
        f"{c.local_batch} ({batch:,} sequences = {batch * setup.seq / 1e6:.1f}M tokens per step), "
        f"{c.estimate_gib:.1f} GiB per GPU"
    )
    span = f" ({d * (1 - frac):.1f} to {d * (1 + frac):.1f} within the band)" if frac else ""
    click.echo(
        f"predicted {days_text(d, days)} days{span}, {d * 24 * n:,.0f} GPU-hours, {rate_text(c.tps)} tokens/s "
        f"per GPU (MFU {c.predicted['mfu']:.1%}); error band {band}"
        if c.predicted
        else f"predicted {days_text(d, days)} days"
    )
