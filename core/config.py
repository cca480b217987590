"""Typed job configuration: TOML (or JSON) file + `--section.key=value` overrides.

No `eval`: override values are parsed as TOML literals. Enum-like fields are `Literal[...]` types
(core/validate.py checks them from the annotation, with every other check made before a process
is spawned); every field carries a one-line doc (`field_docs()`, printed whole by `run-recipe keys`
beside the allowed values, `core.validate.key_choices()`): a doc that explains one value of its
key explains them all (tests/test_config.py checks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib

from core.errors import ConfigError
from core.fileio import atomic_write_json
from core.overrides import parse_override
from core.parallel.stages import PPSchedule

# ------------------------------------------------------------------------------- enum-like fields
# Checked generically from these annotations (`check_choices`); the error lists the valid values.
# Every field carries a one-line doc in its metadata (`field_docs()`); the values need no list there.
Mode = Literal["real", "proxy", "dry-run"]
RopeScaling = Literal["default", "on", "off"]
DatasetKind = Literal["c4", "c4_offline", "synthetic"]
DType = Literal["float32", "bfloat16"]
OptimizerName = Literal["AdamW", "Adam", "SGD"]
DecayType = Literal["linear", "cosine", "none"]
Reshard = Literal["default", "always", "never"]
CPRotate = Literal["allgather", "alltoall"]
ACMode = Literal["none", "full", "selective"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
SharedCache = Literal["auto", "on", "off"]
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
DTYPES: tuple[str, ...] = typing.get_args(DType)


@dataclass
class Job:
    name: str = field(default="job", metadata={"doc": "the run's name, in logs and records"})
    output_dir: str = field(default="runs/job", metadata={"doc": "folder of the run's metrics, checkpoints and record"})
    seed: int = field(default=0, metadata={"doc": "seed of the weights' init and the data order"})
    deterministic: bool = field(default=False, metadata={"doc": "torch.use_deterministic_algorithms"})
    recipe: str = field(
        default="", metadata={"doc": "the recipe row id this job runs, if any (copied into the result record)"}
    )
    mode: Mode = field(
        default="proxy", metadata={"doc": "real | proxy | dry-run (a dry-run never reaches the trainer)"}
    )
    deviations: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "set by run-recipe: the keys where this job differs from its row's configuration for its mode "
            "(copied into the record; `run-recipe check` recomputes them)"
        },
    )
    proxy_world_limit: int = field(
        default=16,
        metadata={
            "doc": "proxy mode refuses larger worlds (proxies are meant for <= 16 CPU ranks); raise it explicitly"
        },
    )


@dataclass
class Model:
    flavor: str = field(
        default="debug", metadata={"doc": "the model's shape (core.models.args.FLAVORS): a CPU proxy's or Llama 3.1's"}
    )
    # The shape keys below replace the flavor's value when non-zero (core.models.args.model_args).
    dim: int = field(default=0, metadata={"doc": "0: the flavor's; model width (n_heads divides it)"})
    n_layers: int = field(default=0, metadata={"doc": "0: the flavor's; transformer blocks (>= pipeline stages)"})
    n_heads: int = field(default=0, metadata={"doc": "0: the flavor's; attention heads (tp divides it)"})
    n_kv_heads: int = field(
        default=0, metadata={"doc": "0: the flavor's; key/value heads (divides n_heads; tp divides it)"}
    )
    vocab_size: int = field(
        default=0, metadata={"doc": "0: the tokenizer's n_words (proxy flavors); real ones keep 128256"}
    )
    ffn_dim_multiplier: float = field(
        default=0.0, metadata={"doc": "0: the flavor's; scales the FFN hidden size (8/3 dim)"}
    )
    multiple_of: int = field(default=0, metadata={"doc": "0: the flavor's; the FFN hidden size rounds up to it"})
    rope_scaling: RopeScaling = field(
        default="default", metadata={"doc": "Llama 3.1 RoPE scaling: default (the flavor's) | on | off"}
    )
    init_device: Literal["auto", "meta"] = field(
        default="auto",
        metadata={
            "doc": "auto: on CPU every rank initialises the whole model, then shards it (the same weights for "
            "every layout); on CUDA the model is built on meta and each rank initialises its shards, seeded per "
            "pipeline stage | meta: that CUDA path on CPU too (tests, preflight)"
        },
    )
    attention_dtype: Literal["auto", "compute", "float32"] = field(
        default="auto",
        metadata={
            "doc": "dtype attention runs in: compute (bf16 under bf16 training) | float32; auto: float32 on CPU, "
            "whose bf16 flash-attention backward is ~2x slower than fp32's, else compute"
        },
    )


@dataclass
class Tokenizer:
    path: str = field(default="assets/tokenizer/proxy_bpe_4k/tokenizer.model", metadata={"doc": "tiktoken BPE file"})
    sha256: str = field(default="", metadata={"doc": "checked when set"})


@dataclass
class Data:
    dataset: DatasetKind = field(
        default="c4_offline", metadata={"doc": "c4 (streamed from the hub) | c4_offline | synthetic"}
    )
    path: str = field(
        default="assets/c4_offline",
        metadata={
            "doc": "local corpus (c4_offline): a folder of c4-<split>.*.json.gz shards in C4's own layout "
            "(<path>/en/ or <path>/), e.g. a local copy of allenai/c4 en"
        },
    )
    sharding: Literal["auto", "global", "per_rank"] = field(
        default="auto",
        metadata={
            "doc": "global: every rank tokenizes the whole global batch and keeps its slice (the same batches for "
            "any layout: parity, proxies) | per_rank: each DP rank reads and tokenizes only its own documents "
            "(scales) | auto: per_rank in real mode, else global"
        },
    )
    skip_bad_documents: bool = field(
        default=False,
        metadata={"doc": "skip (and count in the record) malformed corpus lines instead of stopping at the first"},
    )


@dataclass
class Training:
    steps: int = field(default=10, metadata={"doc": "optimizer steps"})
    local_batch_size: int = field(default=8, metadata={"doc": "sequences per data-parallel rank and step"})
    seq_len: int = field(default=256, metadata={"doc": "tokens per sequence (at most 1,048,576)"})
    grad_accum_steps: int = field(default=1, metadata={"doc": "microsteps accumulated per optimizer step"})
    max_norm: float = field(default=1.0, metadata={"doc": "grad-norm clipping; <= 0 disables"})
    mixed_precision_param: DType = field(
        default="float32", metadata={"doc": "FSDP2 param dtype for compute: bfloat16 | float32"}
    )
    mixed_precision_reduce: DType = field(default="float32", metadata={"doc": "gradient reduction dtype"})
    bf16_gemm: Literal["auto", "native", "fp32"] = field(
        default="auto",
        metadata={
            "doc": "CPU bf16 matmuls: native (torch's kernel) | fp32 (the fp32 GEMM, result rounded to bf16); "
            "auto: fp32 for bf16 training on a CPU without oneDNN's bf16 GEMM (no AVX-512), where torch's is "
            "10-70x slower"
        },
    )
    dataset_infinite: bool = field(default=True, metadata={"doc": "restart the dataset when it ends"})
    skip_nonfinite_steps: int = field(
        default=0,
        metadata={"doc": "steps with a non-finite loss or grad norm skipped (no update) before the run stops; 0 stops"},
    )
    gc_freq: int = field(
        default=50,
        metadata={
            "doc": "Python's garbage collector runs every this many steps, not when it decides; 0: when it decides"
        },
    )


@dataclass
class Optimizer:
    name: OptimizerName = field(default="AdamW", metadata={"doc": "the torch.optim optimizer"})
    lr: float = field(default=3e-4, metadata={"doc": "peak learning rate"})
    eps: float = field(default=1e-8, metadata={"doc": "Adam epsilon"})
    beta1: float = field(default=0.9, metadata={"doc": "Adam beta1"})
    beta2: float = field(default=0.95, metadata={"doc": "Adam beta2"})
    weight_decay: float = field(default=0.1, metadata={"doc": "decoupled weight decay"})
    implementation: Literal["fused", "foreach", "for-loop"] = field(
        default="fused",
        metadata={
            "doc": "Adam(W) kernels: fused (one kernel per step; ~4x faster than foreach on CPU) | foreach (a few "
            "kernels per op over all tensors) | for-loop (one tensor at a time)"
        },
    )


@dataclass
class LRScheduler:
    warmup_steps: int = field(default=2, metadata={"doc": "linear warm-up steps"})
    decay_type: DecayType = field(default="linear", metadata={"doc": "after warm-up: linear | cosine | none"})
    min_lr_factor: float = field(default=0.0, metadata={"doc": "the decay's floor, as a fraction of lr"})


@dataclass
class Parallelism:
    dp_replicate: int = field(default=1, metadata={"doc": "HSDP replicas (> 1 with dp_shard > 1 gives HSDP)"})
    dp_shard: int = field(default=-1, metadata={"doc": "FSDP degree; -1 fills the world left by the others"})
    tp: int = field(default=1, metadata={"doc": "tensor (+ sequence) parallel degree"})
    pp: int = field(default=1, metadata={"doc": "pipeline parallel degree"})
    cp: int = field(default=1, metadata={"doc": "context parallel degree"})
    loss_parallel: bool = field(
        default=True, metadata={"doc": "vocabulary-sharded cross-entropy (only used when tp > 1)"}
    )
    enable_async_tp: bool = field(
        default=False, metadata={"doc": "AsyncTP: overlap TP collectives with matmuls (needs compile)"}
    )
    fsdp_reshard_after_forward: Reshard = field(
        default="default",
        metadata={
            "doc": "always: free each block's gathered parameters after its forward (gathered again for the "
            "backward) | never: keep them (more memory, fewer all-gathers) | default: always, never with PP"
        },
    )
    pp_schedule: PPSchedule = field(default="1F1B", metadata={"doc": "a torch.distributed.pipelining schedule"})
    pp_microbatches: int = field(default=0, metadata={"doc": "0: one per stage"})
    pp_layers_per_stage: int = field(
        default=0, metadata={"doc": "0: split layers evenly over pp * stages_per_rank stages"}
    )
    pp_stages_per_rank: int = field(default=0, metadata={"doc": "0: 1 for single-stage schedules, 2 for looped ones"})
    pp_split_points: list[int] = field(
        default_factory=list, metadata={"doc": "first layer of stages 1.. (overrides the above)"}
    )
    pp_static_shapes: bool = field(
        default=False,
        metadata={
            "doc": "give each pipeline stage its inputs/outputs from the config (microbatch, seq over cp/tp, dim, "
            "dtype, vocab) instead of torch inferring them at step 1 by a forward+backward of each stage in turn"
        },
    )
    cp_rotate_method: CPRotate = field(
        default="allgather", metadata={"doc": "how ring attention passes k/v: allgather | alltoall"}
    )
    world_size: int = field(
        default=0, metadata={"doc": "0: taken from the launcher (WORLD_SIZE) or the product of degrees"}
    )


@dataclass
class ActivationCheckpoint:
    mode: ACMode = field(
        default="none",
        metadata={"doc": "recompute activations in the backward: none | full (every block) | selective (below)"},
    )
    selective_ac_option: str = field(
        default="op", metadata={"doc": '"op", or an integer k: checkpoint every k-th block'}
    )
    save_every_other_mm: bool = field(
        default=False, metadata={"doc": "op SAC: recompute every second matmul (torchtitan's policy)"}
    )


@dataclass
class Compile:
    enabled: bool = field(default=False, metadata={"doc": "torch.compile each transformer block"})
    backend: CompileBackend = field(
        default="inductor",
        metadata={
            "doc": "torch.compile backend: inductor (generated kernels) | aot_eager, eager (debugging: no codegen)"
        },
    )
    fullgraph: bool = field(default=True, metadata={"doc": "one graph per block (no graph breaks)"})
    emulate_precision_casts: bool = field(
        default=False,
        metadata={"doc": "round fused bf16 values as eager does (parity checks; always on for rowwise Float8)"},
    )
    shared_cache: SharedCache = field(
        default="auto",
        metadata={
            "doc": "ranks share compiled graphs (core/toggles/compile_cache.py: patched inductor/AOTAutograd "
            "caches, mesh-aware keys, one rank compiles each graph for all): on | off | auto (on on CPU, off on "
            "CUDA: torch's own caching). Proven on CPU gloo proxies with torch 2.13 only"
        },
    )


@dataclass
class Float8:
    enabled: bool = field(default=False, metadata={"doc": "Float8 linears (torchao)"})
    recipe: Float8Recipe = field(
        default="tensorwise", metadata={"doc": "scaling: tensorwise | rowwise | rowwise_with_gw_hp"}
    )
    enable_fsdp_float8_all_gather: bool = field(
        default=False, metadata={"doc": "all-gather FSDP parameters in float8 (tensorwise)"}
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = field(
        default=False, metadata={"doc": "one amax all-reduce for all parameters"}
    )
    filter_fqns: list[str] = field(
        default_factory=lambda: ["output"], metadata={"doc": "linears left in high precision"}
    )
    emulate: bool = field(
        default=False, metadata={"doc": "torchao's emulation where the hardware lacks float8 matmuls"}
    )


@dataclass
class Checkpoint:
    enabled: bool = field(default=False, metadata={"doc": "save DCP checkpoints"})
    folder: str = field(default="checkpoint", metadata={"doc": "under job.output_dir"})
    interval: int = field(default=500, metadata={"doc": "steps between saves"})
    keep_latest_k: int = field(default=0, metadata={"doc": "0 keeps all"})
    async_mode: AsyncMode = field(
        default="disabled",
        metadata={
            "doc": "what a save blocks: disabled (the whole save) | async (the copy to CPU memory; a thread "
            "writes) | async_with_pinned_mem (only its start; docs/checkpointing.md)"
        },
    )
    model_weights_only: bool = field(default=False, metadata={"doc": "the last save keeps the model only"})
    export_dtype: DType = field(default="float32", metadata={"doc": "dtype of a model-only save"})
    create_seed_checkpoint: bool = field(default=False, metadata={"doc": "save the initial weights and stop"})
    load_step: int = field(default=-1, metadata={"doc": "-1: the latest complete checkpoint, if any"})
    resume_from: str = field(default="", metadata={"doc": "a checkpoint folder to load instead of our own"})


@dataclass
class Metrics:
    log_freq: int = field(default=1, metadata={"doc": "steps between log lines"})
    enable_tensorboard: bool = field(default=False, metadata={"doc": "also write TensorBoard events"})
    peak_flops: float = field(
        default=0.0, metadata={"doc": "0: from the device table (CUDA) or the measured CPU matmul peak"}
    )
    progress: bool = field(default=True, metadata={"doc": "a progress bar on rank 0"})


@dataclass
class Comm:
    init_timeout_seconds: int = field(default=300, metadata={"doc": "first step (compile, lazy init) may be slow"})
    train_timeout_seconds: int = field(default=100, metadata={"doc": "after the first step"})
    checkpoint_timeout_seconds: int = field(
        default=1800, metadata={"doc": "the checkpoint's own group (save, load, manifest): sized for file-system I/O"}
    )
    trace_buf_size: int = field(
        default=0, metadata={"doc": "Flight Recorder entries (TORCH_FR_BUFFER_SIZE); 0 disables"}
    )
    fr_dump_folder: str = field(default="comm_traces", metadata={"doc": "under job.output_dir"})


@dataclass
class Profiling:
    enabled: bool = field(
        default=False,
        metadata={"doc": "the torch profiler over a window of steps: a Chrome trace and an op table per rank"},
    )
    start_step: int = field(default=3, metadata={"doc": "first profiled step (after compile and warm-up)"})
    steps: int = field(default=2, metadata={"doc": "profiled steps from start_step"})
    folder: str = field(default="profile", metadata={"doc": "under job.output_dir"})
    record_shapes: bool = field(default=False, metadata={"doc": "op table rows per input shape (more overhead)"})


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
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)}

# Rank 0 of a multi-job launch (`core.train --config A --config B`) prints this line, then the
# job's output dir, before each job: the launcher splits the output into each job's log by it.
JOB_MARKER = "@@titan-job"


def field_docs() -> dict[str, str]:
    """ "section.key" -> the field's one-line doc, for every key of the config."""
    out = {}
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(_section_class(section.name)):
            out[f"{section.name}.{f.name}"] = f.metadata.get("doc", "")
    return out


# ----------------------------------------------------------------------------------- loading
def flatten_keys(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys of a nested dict (configs, state dicts)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_FIELD_TYPES: dict[type, dict[str, Any]] = {}  # a cache: annotations never change


def field_types(section: type) -> dict[str, Any]:
    """The resolved annotations of a section class."""
    if section not in _FIELD_TYPES:
        _FIELD_TYPES[section] = typing.get_type_hints(section)
    return _FIELD_TYPES[section]


def _section_class(name: str):
    hints = field_types(JobConfig)
    return hints[name]


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check a value against the dataclass field type; ints are accepted for floats."""
    origin = typing.get_origin(typ)
    if origin is Literal:  # a string here; validate() checks the value (check_choices)
        typ = str
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
        hints = field_types(type(obj))
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{section}.{key}: unknown key in {source} (valid: {', '.join(hints)})")
            setattr(obj, key, _coerce(f"{section}.{key}", value, hints[key]))
    return cfg


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot parse: {e}") from None


def load_config(path: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> JobConfig:
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
    atomic_write_json(path, cfg.to_dict())
