"""Every check of a JobConfig, before anything spawns: enum values (`key_choices()`: the model
flavors and the `Literal` annotations of core/config.py), degrees against the world, the model
shape, the pipeline split, toggle combinations, value ranges and (optionally) the files named.
Errors name the key. `validate()` returns a checked copy and never changes its input."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Literal

from core.config import JobConfig, Parallelism, field_types
from core.data.shards import CorpusError, check_corpus
from core.errors import ConfigError
from core.models.args import FLAVORS, ModelArgs, check_shape, model_args
from core.parallel.stages import check_pipeline, static_stage_shapes


def _one_of(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}: {value!r} is not one of: {', '.join(valid)}")


def key_choices() -> dict[str, tuple[str, ...]]:
    """ "section.key" -> the values validate() accepts, for every key with a fixed set of them:
    model.flavor (the FLAVORS of core.models.args) and each `Literal[...]`-typed field, in the
    config's field order. `run-recipe keys` lists them from here, so they never drift."""
    out: dict[str, tuple[str, ...]] = {}
    for section in dataclasses.fields(JobConfig):
        for key, typ in field_types(field_types(JobConfig)[section.name]).items():
            name = f"{section.name}.{key}"
            if name == "model.flavor":
                out[name] = tuple(FLAVORS)
            elif typing.get_origin(typ) is Literal:
                out[name] = typing.get_args(typ)
    return out


def check_choices(cfg: JobConfig) -> None:
    """Every key of `key_choices()` against its values, in the config's field order."""
    for name, valid in key_choices().items():
        section, key = name.split(".")
        _one_of(name, getattr(getattr(cfg, section), key), valid)


def _degrees(p: Parallelism, world_size: int | None) -> tuple[int, int]:
    """(dp_shard with -1 filled, world size); ConfigError when the degrees do not fit the world."""
    for key in ("dp_replicate", "tp", "pp", "cp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key}: must be >= 1, got {getattr(p, key)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallelism.dp_shard: must be >= 1 or -1 (fill), got {p.dp_shard}")
    world = world_size or p.world_size or 0
    others = p.dp_replicate * p.tp * p.pp * p.cp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if not world:
            world = others  # nothing to fill from: dp_shard = 1
        if world % others:
            raise ConfigError(f"parallelism: dp_replicate*tp*pp*cp = {others} does not divide the world size {world}")
        dp_shard = world // others
    product = others * dp_shard
    if world and product != world:
        raise ConfigError(
            f"parallelism: dp_replicate({p.dp_replicate}) * dp_shard({dp_shard}) * cp({p.cp}) * "
            f"tp({p.tp}) * pp({p.pp}) = {product}, not the world size {world}"
        )
    return dp_shard, product


def resolve_world_size(cfg: JobConfig, world_size: int | None = None) -> int:
    """The world size the degrees give (dp_shard = -1 filled from `world_size`); cfg is not changed."""
    return _degrees(cfg.parallelism, world_size)[1]


def _validate_toggles(cfg: JobConfig) -> None:
    """Compile / Float8 / AsyncTP combinations (the hardware is checked by core.hardware)."""
    f, p = cfg.float8, cfg.parallelism
    if f.enable_fsdp_float8_all_gather and f.recipe != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather: needs float8.recipe = 'tensorwise' "
            f"(one scale per tensor), got {f.recipe!r}"
        )
    if f.precompute_float8_dynamic_scale_for_fsdp and not f.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp: needs float8.enable_fsdp_float8_all_gather = true"
        )
    if p.enable_async_tp and p.tp < 2:
        raise ConfigError(f"parallelism.enable_async_tp: needs tensor parallelism (parallelism.tp > 1), got tp {p.tp}")
    if p.enable_async_tp and not cfg.compile.enabled:
        raise ConfigError("parallelism.enable_async_tp: AsyncTP is an inductor pass, it needs compile.enabled = true")


_RANGES = {  # key: (test, what it means); every value must also be finite
    "optimizer.lr": (lambda v: v > 0, "> 0"),
    "optimizer.eps": (lambda v: v > 0, "> 0"),
    "optimizer.beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optimizer.weight_decay": (lambda v: v >= 0, ">= 0"),
    "lr_scheduler.min_lr_factor": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "training.max_norm": (lambda v: True, "a number"),
    "metrics.peak_flops": (lambda v: v >= 0, ">= 0"),
    "training.skip_nonfinite_steps": (lambda v: v >= 0, ">= 0"),
    "training.gc_freq": (lambda v: v >= 0, ">= 0"),
    "job.proxy_world_limit": (lambda v: v >= 1, ">= 1"),
}


# The longest sequence a run may ask for: 4x the paper's longest rows (262,144 tokens, Tables 4
# and 5). The RoPE table, every data window and each attention are this long: a mistyped length
# fails here, not as an out-of-memory in every rank after spawn.
MAX_SEQ_LEN = 1 << 20


def _check_values(cfg: JobConfig) -> None:
    """Numbers in their meaningful range (a NaN learning rate or beta1 = 2 fails here, not in the ranks)."""
    for key, (ok, what) in _RANGES.items():
        v = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
        if not (math.isfinite(v) and ok(v)):
            raise ConfigError(f"{key}: must be finite and {what}, got {v}")
    if cfg.training.seq_len > MAX_SEQ_LEN:
        raise ConfigError(
            f"training.seq_len: {cfg.training.seq_len:,} tokens is above {MAX_SEQ_LEN:,} "
            "(4x the paper's longest sequence, 262,144)"
        )


def _check_tokenizer(cfg: JobConfig) -> int:
    """The tokenizer file parses as one (and matches tokenizer.sha256 when set), before any rank
    loads it; the project's own tokenizers must also have their shape. Returns its vocabulary size."""
    from core.data.tokenizer import Tokenizer  # here: tiktoken is only needed when files are checked
    from core.data.verify import project_asset, tokenizer_shape_problems

    try:
        tok = Tokenizer(cfg.tokenizer.path, cfg.tokenizer.sha256 or None)
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a tokenizer"
        raise ConfigError(
            f"tokenizer.path: {cfg.tokenizer.path} is not a readable tokenizer "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    asset = project_asset(cfg.tokenizer.path, "tokenizer")
    problems = tokenizer_shape_problems(asset, tok.n_words, tok.bos_id, tok.eos_id) if asset else []
    if problems:
        raise ConfigError("\n".join(problems))
    return tok.n_words


def check_assets(cfg: JobConfig) -> int | None:
    """The project's assets the run reads against assets/MANIFEST.json (one line per missing,
    extra or changed file), then the tokenizer itself; its vocabulary size (None: synthetic data)."""
    from core.data.verify import verify_assets  # here: it imports tiktoken

    verify_assets(cfg.tokenizer.path, cfg.data.dataset, cfg.data.path)
    if cfg.data.dataset == "synthetic":
        return None
    if not Path(cfg.tokenizer.path).is_file():
        raise ConfigError(
            f"tokenizer.path: {cfg.tokenizer.path} does not exist (build it: python -m core.data.assets --all)"
        )
    n_words = _check_tokenizer(cfg)
    if cfg.model.vocab_size and cfg.model.vocab_size < n_words:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is below the {n_words} ids of the tokenizer "
            f"{cfg.tokenizer.path} (0: the tokenizer's)"
        )
    return n_words


def validate(cfg: JobConfig, world_size: int | None = None, check_files: bool = True) -> JobConfig:
    """Every check that needs no process group; ConfigError naming the key. Returns a checked copy
    with the world resolved (parallelism.dp_shard = -1 filled, parallelism.world_size set); `cfg`
    itself is not changed."""
    check_choices(cfg)
    sac = cfg.activation_checkpoint.selective_ac_option
    if sac != "op" and not (sac.isdigit() and int(sac) >= 1):
        raise ConfigError(f"activation_checkpoint.selective_ac_option: {sac!r} must be 'op' or an integer >= 1")
    _validate_toggles(cfg)
    t = cfg.training
    for key in ("steps", "local_batch_size", "seq_len", "grad_accum_steps"):
        if getattr(t, key) < 1:
            raise ConfigError(f"training.{key}: must be >= 1, got {getattr(t, key)}")
    _check_values(cfg)
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps: must be >= 0, got {cfg.lr_scheduler.warmup_steps}")
    if cfg.checkpoint.interval < 1:
        raise ConfigError(f"checkpoint.interval: must be >= 1, got {cfg.checkpoint.interval}")
    if cfg.checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {cfg.checkpoint.keep_latest_k}")
    if cfg.checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step: must be >= 0, or -1 for the latest, got {cfg.checkpoint.load_step}")
    for key in ("checkpoint.folder", "comm.fr_dump_folder"):
        _check_sub_folder(cfg, key)
    for key in ("init_timeout_seconds", "train_timeout_seconds", "checkpoint_timeout_seconds"):
        if getattr(cfg.comm, key) <= 0:
            raise ConfigError(f"comm.{key}: must be > 0, got {getattr(cfg.comm, key)}")
    if cfg.comm.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size: must be >= 0 (0 disables), got {cfg.comm.trace_buf_size}")
    if cfg.metrics.log_freq < 1:
        raise ConfigError(f"metrics.log_freq: must be >= 1, got {cfg.metrics.log_freq}")
    _check_profiling(cfg)

    dp_shard, world = _degrees(cfg.parallelism, world_size)
    cfg = copy.deepcopy(cfg)  # the caller's config stays as it was
    p = cfg.parallelism
    p.dp_shard, p.world_size = dp_shard, world
    if cfg.job.mode == "proxy" and world > cfg.job.proxy_world_limit:
        raise ConfigError(
            f"parallelism: a proxy world of {world} ranks is above job.proxy_world_limit="
            f"{cfg.job.proxy_world_limit} (proxies are CPU runs of <= 16 ranks); set "
            "job.proxy_world_limit explicitly to allow it"
        )
    args = check_shape(cfg)  # the flavor with the model.dim, ... overrides; ConfigError naming the key
    _check_layout(cfg, args)
    n_words = None  # the tokenizer's vocabulary, when its file is read
    if check_files:
        n_words = check_assets(cfg)
        if cfg.data.dataset == "c4_offline":
            try:
                check_corpus(cfg.data.path)
            except CorpusError as e:
                raise ConfigError(str(e)) from None
        if cfg.checkpoint.resume_from and not Path(cfg.checkpoint.resume_from).exists():
            raise ConfigError(f"checkpoint.resume_from: {cfg.checkpoint.resume_from} does not exist")
    if p.pp > 1 and p.pp_static_shapes:  # the stages' example shapes, with the vocabulary the model will have
        static_stage_shapes(cfg, args.n_layers, args.dim, model_args(cfg, n_words).vocab_size)
    return cfg


def _check_layout(cfg: JobConfig, args: ModelArgs) -> None:
    """The degrees against the model's shape, the pipeline split and the sequence's shards."""
    t, p = cfg.training, cfg.parallelism
    for key in ("n_heads", "n_kv_heads", "ffn_hidden_dim") + (("vocab_size",) if cfg.model.vocab_size else ()):
        if getattr(args, key) % p.tp:
            raise ConfigError(
                f"parallelism.tp: {p.tp} does not divide model {key} {getattr(args, key)} ({cfg.model.flavor})"
            )
    if p.pp > 1:
        check_pipeline(cfg, args.n_layers)
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"training.seq_len: {t.seq_len} must divide by 2 x cp = {2 * p.cp} (load-balanced context parallel)"
        )
    if p.tp > 1 and t.seq_len % p.tp:
        raise ConfigError(f"training.seq_len: {t.seq_len} must divide by tp {p.tp} (sequence parallel)")
    if p.tp > 1 and p.cp > 1 and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"training.seq_len: the {t.seq_len // p.cp} tokens of a cp rank must divide by "
            f"tp {p.tp} (sequence parallel inside context parallel)"
        )


def _check_profiling(cfg: JobConfig) -> None:
    prof, steps = cfg.profiling, cfg.training.steps
    if not prof.enabled:
        return
    if prof.start_step < 1 or prof.steps < 1:
        raise ConfigError(f"profiling: start_step and steps must be >= 1, got {prof.start_step} and {prof.steps}")
    last = prof.start_step + prof.steps - 1
    if last > steps:
        raise ConfigError(
            f"profiling.start_step: steps {prof.start_step}..{last} run past training.steps={steps} "
            "(lower profiling.start_step or profiling.steps)"
        )
    _check_sub_folder(cfg, "profiling.folder")
    if os.path.normpath(prof.folder) == os.path.normpath(cfg.checkpoint.folder):
        raise ConfigError(f"profiling.folder: {prof.folder!r} is the checkpoint's folder: name another")


def _check_sub_folder(cfg: JobConfig, key: str) -> None:
    """A folder key read under job.output_dir names a folder inside it: `../x` or an absolute
    path would write outside the run folder (and another run's lock would not cover it)."""
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    if os.path.isabs(value) or os.path.normpath(value) in (".", "..") or ".." in Path(value).parts:
        raise ConfigError(f"{key}: {value!r} must be a sub-folder of job.output_dir (no '..', not absolute)")
