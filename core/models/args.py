"""Llama 3.1 model arguments and the flavor table, without torch.

The config's validation, the dry-run's memory accounting and the layout advisor size a model
from these alone; `core.models.llama3` builds the module from the same `ModelArgs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import ConfigError

if TYPE_CHECKING:  # type names only: core.config imports this module
    from core.config import JobConfig

# Llama 3.1 RoPE frequency scaling (the published constants); the original context length is a
# ModelArgs field so a test can shrink it and make scaling matter at a short sequence length.
ROPE_SCALING_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0

# Proxy flavors get their vocabulary from the tokenizer at build time; this is the default:
# 4096 BPE merges + 256 special tokens.
PROXY_VOCAB_SIZE = 4352
LLAMA3_VOCAB_SIZE = 128256


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None -> n_heads (plain multi-head attention)
    vocab_size: int = LLAMA3_VOCAB_SIZE
    multiple_of: int = 256  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False  # Llama 3.1 frequency scaling (factor 8, low 1, high 4)
    rope_original_max_seq_len: int = 8192  # the scaling's "original context length"
    max_seq_len: int = 8192  # rows of freqs_cis; at least the training sequence length
    depth_init: bool = True  # output-projection init std shrinks with the layer's depth
    attention_fp32: bool = False  # attention in float32 whatever the activations' dtype

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Meta's rule: 2/3 of 4*dim, times the multiplier, rounded up to ``multiple_of``."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


FLAVORS: dict[str, ModelArgs] = {
    # Small proxies (vocab set by the tokenizer at build time). n_kv_heads and the FFN hidden size
    # divide by the tensor-parallel degrees the proxies use.
    "tiny": ModelArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=PROXY_VOCAB_SIZE, multiple_of=32, max_seq_len=512
    ),
    "tiny4": ModelArgs(
        dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=PROXY_VOCAB_SIZE, multiple_of=32, max_seq_len=512
    ),
    # Eight stages for looped pipeline schedules at pp 4 x 2 stages per rank.
    "tiny8": ModelArgs(
        dim=64, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=PROXY_VOCAB_SIZE, multiple_of=32, max_seq_len=512
    ),
    "debug": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=PROXY_VOCAB_SIZE, multiple_of=256, max_seq_len=2048
    ),
    "small": ModelArgs(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=PROXY_VOCAB_SIZE, multiple_of=256, max_seq_len=2048
    ),
    # The published Llama 3.1 models (context length 128K).
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_scaling=True,
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=True,
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_scaling=True,
        max_seq_len=131072,
    ),
}


def get_args(
    flavor_or_args: str | ModelArgs, vocab_size: int | None = None, max_seq_len: int | None = None
) -> ModelArgs:
    """A fresh ModelArgs for a flavor name (or a copy of the given args) with overrides applied."""
    if isinstance(flavor_or_args, str):
        if flavor_or_args not in FLAVORS:
            raise KeyError(f"unknown flavor {flavor_or_args!r}; known: {sorted(FLAVORS)}")
        args = FLAVORS[flavor_or_args]
    else:
        args = flavor_or_args
    overrides = {}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    return dataclasses.replace(args, **overrides)


def param_count(flavor_or_args: str | ModelArgs, exclude_embedding: bool = False) -> int:
    """Analytic parameter count; ``exclude_embedding`` drops ``tok_embeddings`` (not ``output``)."""
    a = get_args(flavor_or_args)
    kv_dim = a.n_kv_heads * a.head_dim
    attention = a.dim * a.dim * 2 + a.dim * kv_dim * 2  # wq, wo, wk, wv
    ffn = 3 * a.dim * a.ffn_hidden_dim
    per_layer = attention + ffn + 2 * a.dim  # + two norms
    embedding = a.vocab_size * a.dim
    total = embedding + a.n_layers * per_layer + a.dim + a.vocab_size * a.dim  # + norm, output
    return total - embedding if exclude_embedding else total


# `model.<key>` of the job config that replace the flavor's value when set (0 keeps the flavor's).
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "ffn_dim_multiplier")


def shape_overrides(cfg: JobConfig) -> dict:
    """The config's shape overrides of its flavor: {key: value} for the keys set (non-zero)."""
    return {k: getattr(cfg.model, k) for k in SHAPE_KEYS if getattr(cfg.model, k)}


def check_shape(cfg: JobConfig) -> ModelArgs:
    """The flavor with the config's shape overrides, checked: ConfigError naming the `model.` key
    (the tokenizer's vocabulary is not known here; the model is otherwise the job's)."""
    m = cfg.model
    for key in (*SHAPE_KEYS, "vocab_size"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}: must be >= 0 (0: the flavor's), got {getattr(m, key)}")
    a = FLAVORS[m.flavor]
    shape = {k: getattr(a, k) for k in SHAPE_KEYS} | shape_overrides(cfg)
    dim, heads, kv = shape["dim"], shape["n_heads"], shape["n_kv_heads"] or shape["n_heads"]
    src = f"model.dim {dim}" + ("" if m.dim else f" ({m.flavor})")
    if dim % heads:
        raise ConfigError(f"model.n_heads: {heads} does not divide {src}")
    if (dim // heads) % 2:
        raise ConfigError(f"model.n_heads: head dim {src} / n_heads {heads} = {dim // heads} must be even (RoPE)")
    if heads % kv:
        raise ConfigError(
            f"model.n_kv_heads: {kv} does not divide model.n_heads {heads}"
            + ("" if m.n_kv_heads else f" (the {m.flavor} flavor's n_kv_heads: set model.n_kv_heads)")
        )
    return model_args(cfg, None)


def model_args(cfg: JobConfig, vocab_size: int | None) -> ModelArgs:
    """The job's model: its flavor with the config's shape (`model.dim`, ...), vocabulary, RoPE
    scaling and sequence length.

    `vocab_size` is the tokenizer's (None when there is none, e.g. the dry-run): proxy flavors
    follow it unless `model.vocab_size` is set; the published flavors keep Llama 3's.
    """
    args = dataclasses.replace(FLAVORS[cfg.model.flavor], **shape_overrides(cfg))
    if cfg.model.vocab_size:
        args.vocab_size = cfg.model.vocab_size
    elif vocab_size and args.vocab_size != LLAMA3_VOCAB_SIZE:  # proxy flavors follow their tokenizer
        args.vocab_size = vocab_size
    if cfg.model.rope_scaling != "default":
        args.rope_scaling = cfg.model.rope_scaling == "on"
    # RoPE table exactly one sequence long: context parallel shards it with the tokens.
    args.max_seq_len = cfg.training.seq_len
    return args


SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim")


def model_shape(args: ModelArgs) -> dict:
    """What a checkpoint's weights need to match (titan.json's `model_shape`)."""
    return {k: getattr(args, k) for k in SHAPE_FIELDS}


def shape_record(args: ModelArgs) -> dict:
    """The resolved shape and analytic parameter count, as a result record carries them."""
    return {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "attention_dtype": "float32" if args.attention_fp32 else "compute",
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "ffn_hidden_dim": args.ffn_hidden_dim,
        "multiple_of": args.multiple_of,
        "ffn_dim_multiplier": args.ffn_dim_multiplier,
        "param_count": param_count(args),
    }
