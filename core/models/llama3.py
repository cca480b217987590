"""Llama 3.1, in one file you can read top to bottom.

The model knows nothing about parallelism. The parallel modules in ``core/parallel`` rely only
on the module names and a few conventions kept here:

- ``Transformer.layers`` is an ``nn.ModuleDict`` keyed "0".."n-1": pipeline splitting deletes
  entries (and sets ``tok_embeddings`` / ``norm`` / ``output`` to None) and the fully qualified
  names of what is left stay the same as in the whole model, so checkpoints line up.
- Attention reshapes with ``-1`` heads, so a tensor-parallel shard that holds only some of the
  heads runs the same code.
- ``Attention.inner_attention`` is a parameter-free module around
  ``F.scaled_dot_product_attention(is_causal=True)``: context parallelism targets it.
- ``freqs_cis`` is a non-persistent buffer of ``max_seq_len`` rows, sliced to the input's
  sequence length in ``apply_rotary_emb``. (For context parallelism build the model with
  ``max_seq_len == seq_len``, so the buffer is sharded along the sequence like the inputs.)

Construction on the meta device and materialisation::

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()

Numerics: RMSNorm and RoPE compute in float32 and cast back to the input dtype. freqs_cis is
complex64; ``model.to(torch.bfloat16)`` would drop its imaginary part (forward then raises), so
lower precision comes from a mixed-precision policy (FSDP2), not from casting the module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The arguments live in the torch-free core.models.args; re-exported here for the model's users.
from core.models.args import (
    FLAVORS,
    LLAMA3_VOCAB_SIZE,
    PROXY_VOCAB_SIZE,
    ROPE_HIGH_FREQ_FACTOR,
    ROPE_LOW_FREQ_FACTOR,
    ROPE_SCALING_FACTOR,
    ModelArgs,
    get_args,
    param_count,
)

__all__ = [
    "FLAVORS",
    "LLAMA3_VOCAB_SIZE",
    "PROXY_VOCAB_SIZE",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "ScaledDotProductAttention",
    "Transformer",
    "TransformerBlock",
    "apply_rope_scaling",
    "apply_rotary_emb",
    "count_params",
    "create_model",
    "get_args",
    "precompute_freqs_cis",
    "repeat_kv",
]

# ----------------------------------------------------------------------------------------------
# Rotary position embedding (Meta's interleaved layout: pairs (x0, x1), (x2, x3), ... are complex)
# ----------------------------------------------------------------------------------------------


def apply_rope_scaling(freqs: torch.Tensor, original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by the factor, blend in between."""
    low_freq_wavelen = original_max_seq_len / ROPE_LOW_FREQ_FACTOR
    high_freq_wavelen = original_max_seq_len / ROPE_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_seq_len / wavelen - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
    blended = (1 - smooth) * freqs / ROPE_SCALING_FACTOR + smooth * freqs
    return torch.where(
        wavelen < high_freq_wavelen,
        freqs,
        torch.where(wavelen > low_freq_wavelen, freqs / ROPE_SCALING_FACTOR, blended),
    )


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    """(max_seq_len, head_dim // 2) complex64 rotations e^{i * pos * freq}."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if args.rope_scaling:
        freqs = apply_rope_scaling(freqs, args.rope_original_max_seq_len)
    positions = torch.arange(args.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Rotate q and k, shaped (bs, seqlen, heads, head_dim), by freqs_cis (seqlen, head_dim // 2)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    # Sliced here, not by the caller: under sequence parallelism the block's input is a slice of
    # the sequence while attention sees all of it.
    freqs_cis = freqs_cis[: xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, seqlen, n_kv_heads, head_dim) -> (bs, seqlen, n_kv_heads * n_rep, head_dim)."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


class ScaledDotProductAttention(nn.Module):
    """Causal attention on (bs, heads, seqlen, head_dim); no parameters (context parallel hooks it).

    ``fp32``: run the kernel in float32 and return the input's dtype (autocast would cast it
    back to bf16): on CPU the bf16 flash-attention backward is about twice as slow as fp32's.
    """

    def __init__(self, fp32: bool = False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.fp32 or q.dtype == torch.float32:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.autocast(q.device.type, enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        return out.to(q.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads  # unchanged when TP divides both head counts
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = ScaledDotProductAttention(args.attention_fp32)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: a tensor-parallel shard sees only its local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        out = self.inner_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, init_std: float | None = None):
        init_std = self.weight_init_std if init_std is None else init_std
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(init_std)
        self.feed_forward.init_weights(init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_weights(self, buffer_device: str | torch.device | None = None):
        """(Re)initialise every parameter and freqs_cis in place; works on a pipeline stage too.

        After ``to_empty`` the buffer holds garbage, so it is recomputed on ``buffer_device``
        (default: where the buffer already lives).
        """
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = precompute_freqs_cis(self.args)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (bs, seqlen) int64 -> fp32 logits (bs, seqlen, vocab).

        On a pipeline stage without ``tok_embeddings`` the input is already hidden states
        (bs, seqlen, dim); without ``norm``/``output`` the hidden states are returned.
        """
        if not self.freqs_cis.is_complex():
            raise RuntimeError(
                "freqs_cis lost its imaginary part: was the model cast with "
                ".to(dtype)? Use a mixed-precision policy instead"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs_cis = self.freqs_cis  # apply_rotary_emb slices it to the attention's sequence
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        # fp32 logits, as torchtitan's model returns them (the loss upcasts them anyway): under PP
        # the schedule keeps each microbatch's output, so the paper's memory includes them.
        return self.output(h).float() if self.output is not None else h


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def count_params(model_or_args: nn.Module | ModelArgs | str, exclude_embedding: bool = False) -> int:
    """Number of parameters; ``exclude_embedding`` drops ``tok_embeddings`` (not ``output``).

    For ModelArgs (or a flavor name) the count is analytic; for a module it sums what the module
    holds (meta tensors count too; a pipeline stage counts only its own part).
    """
    if isinstance(model_or_args, nn.Module):
        model = model_or_args
        total = sum(p.numel() for p in model.parameters())
        emb = getattr(model, "tok_embeddings", None)
        if exclude_embedding and emb is not None:
            total -= emb.weight.numel()
        return total
    return param_count(model_or_args, exclude_embedding)


def create_model(
    flavor_or_args: str | ModelArgs,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    device: str | torch.device = "meta",
) -> Transformer:
    """The whole Transformer on ``device``. On "meta" nothing is allocated: call
    ``to_empty(device=...)`` and ``init_weights()`` after parallelising. On a real device the
    weights are initialised here, from torch's current RNG state. (The parallel build of a
    rank's share is core/build.py's ``build_model``, which starts from this.)"""
    args = get_args(flavor_or_args, vocab_size=vocab_size, max_seq_len=max_seq_len)
    with torch.device(device):
        model = Transformer(args)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model
