"""Typed job configuration: TOML (or JSON) file + `--section.key=value` overrides + validation.

Every check that can be made before a process is spawned is made here, and each failure is a
one-line `ConfigError` naming the key. No `eval`: override values are parsed as TOML literals.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from core.errors import ConfigError
from core.models.args import FLAVORS
from core.parallel.stages import PP_SCHEDULES, check_pipeline


@dataclass
class Job:
    name: str = "job"
    output_dir: str = "runs/job"
    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms
    recipe: str = ""  # the recipe row id this job runs, if any (copied into the result record)
    mode: str = "proxy"  # real | proxy (dry-run never reaches the trainer)


@dataclass
class Model:
    flavor: str = "debug"  # a key of core.models.args.FLAVORS
    vocab_size: int = 0  # 0: take the tokenizer's n_words (proxy flavors); real flavors keep 128256
    rope_scaling: str = "default"  # default (the flavor's) | on | off


@dataclass
class Tokenizer:
    path: str = "assets/tokenizer/proxy_bpe_4k/tokenizer.model"
    sha256: str = ""  # checked when set


@dataclass
class Data:
    dataset: str = "c4_offline"  # c4 | c4_offline | synthetic
    path: str = "assets/c4_offline"  # local corpus (c4_offline)


@dataclass
class Training:
    steps: int = 10
    local_batch_size: int = 8
    seq_len: int = 256
    grad_accum_steps: int = 1
    max_norm: float = 1.0  # grad-norm clipping; <= 0 disables
    mixed_precision_param: str = "float32"  # bfloat16 | float32 (FSDP2 param dtype for compute)
    mixed_precision_reduce: str = "float32"  # gradient reduction dtype
    dataset_infinite: bool = True


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 3e-4
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    decay_type: str = "linear"  # linear | cosine | none
    min_lr_factor: float = 0.0


@dataclass
class Parallelism:
    dp_replicate: int = 1  # HSDP replicas (> 1 with dp_shard > 1 gives HSDP)
    dp_shard: int = -1  # FSDP degree; -1 fills the world left by the others
    tp: int = 1
    pp: int = 1
    cp: int = 1
    loss_parallel: bool = True  # only used when tp > 1
    enable_async_tp: bool = False
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0  # 0: one per stage
    pp_layers_per_stage: int = 0  # 0: split layers evenly over pp * stages_per_rank stages
    pp_stages_per_rank: int = 0  # 0: 1 for single-stage schedules, 2 for looped ones
    pp_split_points: list[int] = field(default_factory=list)  # first layer of stages 1.. (overrides the above)
    cp_rotate_method: str = "allgather"  # allgather | alltoall
    world_size: int = 0  # 0: taken from the launcher (WORLD_SIZE) or the product of degrees


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective
    selective_ac_option: str = "op"  # "op", or an integer k: checkpoint every k-th block
    # op SAC: recompute every second matmul instead of saving it (torchtitan's policy, the paper's)
    save_every_other_mm: bool = False


@dataclass
class Compile:
    enabled: bool = False
    backend: str = "inductor"
    fullgraph: bool = True
    # Round fused bf16 intermediates as eager does (inductor keeps them in fp32): for parity checks.
    emulate_precision_casts: bool = False


@dataclass
class Float8:
    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    emulate: bool = False  # torchao's emulation where the hardware lacks float8 matmuls


@dataclass
class Checkpoint:
    enabled: bool = False
    folder: str = "checkpoint"  # under job.output_dir
    interval: int = 500
    keep_latest_k: int = 0  # 0 keeps all
    async_mode: str = "disabled"  # disabled | async | async_with_pinned_mem
    model_weights_only: bool = False  # the last save keeps the model only
    export_dtype: str = "float32"
    create_seed_checkpoint: bool = False
    load_step: int = -1  # -1: the latest complete checkpoint, if any
    resume_from: str = ""  # a checkpoint folder to load instead of our own


@dataclass
class Metrics:
    log_freq: int = 1
    enable_tensorboard: bool = False
    peak_flops: float = 0.0  # 0: from the device table (CUDA) or the measured CPU matmul peak
    progress: bool = True


@dataclass
class Comm:
    init_timeout_seconds: int = 300  # first step (compile, lazy init) may be slow
    train_timeout_seconds: int = 100  # after the first step
    trace_buf_size: int = 0  # Flight Recorder entries (TORCH_FR_BUFFER_SIZE); 0 disables
    fr_dump_folder: str = "comm_traces"  # under job.output_dir


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)}


# ----------------------------------------------------------------------------------- loading
def _section_class(name: str):
    hints = typing.get_type_hints(JobConfig)
    return hints[name]


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check a value against the dataclass field type; ints are accepted for floats."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {typ}")


def apply_dict(cfg: JobConfig, data: dict[str, Any], source: str = "config") -> JobConfig:
    """Merge a nested {section: {key: value}} dict into cfg, rejecting unknown keys."""
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section in {source} (valid: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a table of keys in {source}, got {values!r}")
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(
                    f"{section}.{key}: unknown key in {source} (valid: {', '.join(hints)})"
                )
            setattr(obj, key, _coerce(f"{section}.{key}", value, hints[key]))
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' (a leading '--' is allowed) -> (section, key, value).

    The value is read as a TOML literal (numbers, booleans, quoted strings, lists); anything
    that is not a valid literal is taken as a bare string.
    """
    body = text.removeprefix("--")
    if "=" not in body:
        raise ConfigError(f"{text}: an override must look like section.key=value")
    dotted, raw = body.split("=", 1)
    if dotted.count(".") != 1:
        raise ConfigError(f"{dotted}: an override key must be section.key")
    section, key = dotted.split(".")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot parse: {e}") from None


def load_config(path: str | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> JobConfig:
    """Defaults <- base dict <- file <- overrides, then nothing else: call validate() separately."""
    cfg = JobConfig()
    if base:
        apply_dict(cfg, base, "base")
    if path:
        apply_dict(cfg, load_file(path), str(path))
    for text in overrides or []:
        section, key, value = parse_override(text)
        apply_dict(cfg, {section: {key: value}}, "overrides")
    return cfg


def save_config(cfg: JobConfig, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


# -------------------------------------------------------------------------------- validation
DTYPES = ("float32", "bfloat16")


def _one_of(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}: {value!r} is not one of: {', '.join(valid)}")


def resolve_world_size(cfg: JobConfig, world_size: int | None = None) -> int:
    """Fill dp_shard=-1 and check the degrees multiply to the world size. Returns the world size."""
    p = cfg.parallelism
    for key in ("dp_replicate", "tp", "pp", "cp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key}: must be >= 1, got {getattr(p, key)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallelism.dp_shard: must be >= 1 or -1 (fill), got {p.dp_shard}")
    world = world_size or p.world_size or 0
    others = p.dp_replicate * p.tp * p.pp * p.cp
    if p.dp_shard == -1:
        if not world:
            world = others  # nothing to fill from: dp_shard = 1
        if world % others:
            raise ConfigError(
                f"parallelism: dp_replicate*tp*pp*cp = {others} does not divide the world size {world}")
        p.dp_shard = world // others
    product = others * p.dp_shard
    if world and product != world:
        raise ConfigError(
            f"parallelism: dp_replicate({p.dp_replicate}) * dp_shard({p.dp_shard}) * cp({p.cp}) * "
            f"tp({p.tp}) * pp({p.pp}) = {product}, not the world size {world}")
    p.world_size = product
    return product


def _validate_toggles(cfg: JobConfig) -> None:
    """Compile / Float8 / AsyncTP combinations (the hardware is checked by core.optim.hardware)."""
    f, p = cfg.float8, cfg.parallelism
    _one_of("compile.backend", cfg.compile.backend, ("inductor", "aot_eager", "eager"))
    if f.enable_fsdp_float8_all_gather and f.recipe != "tensorwise":
        raise ConfigError(f"float8.enable_fsdp_float8_all_gather: needs float8.recipe = 'tensorwise' "
                          f"(one scale per tensor), got {f.recipe!r}")
    if f.precompute_float8_dynamic_scale_for_fsdp and not f.enable_fsdp_float8_all_gather:
        raise ConfigError("float8.precompute_float8_dynamic_scale_for_fsdp: needs "
                          "float8.enable_fsdp_float8_all_gather = true")
    if p.enable_async_tp and p.tp < 2:
        raise ConfigError(f"parallelism.enable_async_tp: needs tensor parallelism (parallelism.tp > 1), got tp {p.tp}")
    if p.enable_async_tp and not cfg.compile.enabled:
        raise ConfigError("parallelism.enable_async_tp: AsyncTP is an inductor pass, it needs compile.enabled = true")


def validate(cfg: JobConfig, world_size: int | None = None, check_files: bool = True) -> JobConfig:
    """Every check that needs no process group. Raises ConfigError naming the key."""
    t, p = cfg.training, cfg.parallelism
    if cfg.model.flavor not in FLAVORS:
        raise ConfigError(f"model.flavor: {cfg.model.flavor!r} is not one of: {', '.join(FLAVORS)}")
    _one_of("model.rope_scaling", cfg.model.rope_scaling, ("default", "on", "off"))
    _one_of("data.dataset", cfg.data.dataset, ("c4", "c4_offline", "synthetic"))
    _one_of("training.mixed_precision_param", t.mixed_precision_param, DTYPES)
    _one_of("training.mixed_precision_reduce", t.mixed_precision_reduce, DTYPES)
    _one_of("optimizer.name", cfg.optimizer.name, ("AdamW", "Adam", "SGD"))
    _one_of("lr_scheduler.decay_type", cfg.lr_scheduler.decay_type, ("linear", "cosine", "none"))
    _one_of("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward,
            ("default", "always", "never"))
    _one_of("parallelism.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    _one_of("parallelism.cp_rotate_method", p.cp_rotate_method, ("allgather", "alltoall"))
    _one_of("activation_checkpoint.mode", cfg.activation_checkpoint.mode, ("none", "full", "selective"))
    sac = cfg.activation_checkpoint.selective_ac_option
    if sac != "op" and not (sac.isdigit() and int(sac) >= 1):
        raise ConfigError(f"activation_checkpoint.selective_ac_option: {sac!r} must be 'op' or an integer >= 1")
    _one_of("float8.recipe", cfg.float8.recipe, ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    _validate_toggles(cfg)
    _one_of("checkpoint.async_mode", cfg.checkpoint.async_mode, ("disabled", "async", "async_with_pinned_mem"))
    _one_of("checkpoint.export_dtype", cfg.checkpoint.export_dtype, DTYPES)
    for key in ("steps", "local_batch_size", "seq_len", "grad_accum_steps"):
        if getattr(t, key) < 1:
            raise ConfigError(f"training.{key}: must be >= 1, got {getattr(t, key)}")
    if cfg.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr: must be > 0, got {cfg.optimizer.lr}")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps: must be >= 0, got {cfg.lr_scheduler.warmup_steps}")
    if cfg.checkpoint.interval < 1:
        raise ConfigError(f"checkpoint.interval: must be >= 1, got {cfg.checkpoint.interval}")
    if cfg.checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {cfg.checkpoint.keep_latest_k}")
    if cfg.checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step: must be >= 0, or -1 for the latest, got {cfg.checkpoint.load_step}")
    if cfg.checkpoint.folder in ("", ".", "..") or os.path.isabs(cfg.checkpoint.folder):
        raise ConfigError(f"checkpoint.folder: {cfg.checkpoint.folder!r} must be a sub-folder name of job.output_dir")
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        if getattr(cfg.comm, key) <= 0:
            raise ConfigError(f"comm.{key}: must be > 0, got {getattr(cfg.comm, key)}")
    if cfg.comm.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size: must be >= 0 (0 disables), got {cfg.comm.trace_buf_size}")
    if cfg.metrics.log_freq < 1:
        raise ConfigError(f"metrics.log_freq: must be >= 1, got {cfg.metrics.log_freq}")

    resolve_world_size(cfg, world_size)
    args = FLAVORS[cfg.model.flavor]
    if args.n_heads % p.tp:
        raise ConfigError(f"parallelism.tp: {p.tp} does not divide model n_heads {args.n_heads} ({cfg.model.flavor})")
    if args.n_kv_heads % p.tp:
        raise ConfigError(
            f"parallelism.tp: {p.tp} does not divide model n_kv_heads {args.n_kv_heads} ({cfg.model.flavor})")
    if p.pp > 1:
        check_pipeline(cfg, args.n_layers)
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"training.seq_len: {t.seq_len} must divide by 2 x cp = {2 * p.cp} (load-balanced context parallel)")
    if p.tp > 1 and t.seq_len % p.tp:
        raise ConfigError(f"training.seq_len: {t.seq_len} must divide by tp {p.tp} (sequence parallel)")
    if p.tp > 1 and p.cp > 1 and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(f"training.seq_len: the {t.seq_len // p.cp} tokens of a cp rank must divide by "
                          f"tp {p.tp} (sequence parallel inside context parallel)")
    if t.seq_len > args.max_seq_len and cfg.model.flavor not in ("8B", "70B", "405B"):
        pass  # proxy flavors size their RoPE table from training.seq_len at build time
    if check_files:
        if cfg.data.dataset == "c4_offline" and not Path(cfg.data.path).exists():
            raise ConfigError(
                f"data.path: {cfg.data.path} does not exist (build it: python -m core.data.assets --corpus)")
        if cfg.data.dataset != "synthetic" and not Path(cfg.tokenizer.path).is_file():
            raise ConfigError(
                f"tokenizer.path: {cfg.tokenizer.path} does not exist (build it: python -m core.data.assets --all)")
        if cfg.checkpoint.resume_from and not Path(cfg.checkpoint.resume_from).exists():
            raise ConfigError(f"checkpoint.resume_from: {cfg.checkpoint.resume_from} does not exist")
    return cfg
