"""Interchange with Hugging Face ``transformers.LlamaForCausalLM`` checkpoints.

Key map (ours -> HF)::

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.{i}.attention_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.wq/wk/wv/wo      model.layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj
    layers.{i}.ffn_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1/w3/w2      model.layers.{i}.mlp.gate_proj/up_proj/down_proj
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight

RoPE layouts differ: Meta rotates adjacent pairs (x0, x1), (x2, x3), ... (the complex view); HF
rotates the two halves of each head (x_j, x_{j + head_dim/2}). Rotary attention is invariant to
a fixed permutation of the q and k output rows inside each head, so converting permutes the rows
of wq and wk: per head, row 2j -> j and row 2j+1 -> j + head_dim/2.

Partial state dicts (a pipeline stage) convert key by key. Tensors must be plain (call
``full_tensor()`` on DTensors first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch

from core.models.args import ROPE_HIGH_FREQ_FACTOR, ROPE_LOW_FREQ_FACTOR, ROPE_SCALING_FACTOR, ModelArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta (pairs) -> HF (halves) row order of a q or k projection weight (out, in)."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF (halves) -> Meta (pairs): the inverse of ``_interleaved_to_halves``."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> ``LlamaForCausalLM`` state dict (q/k rows permuted to HF's layout)."""
    hf = {}
    for key, value in state_dict.items():
        if key == "freqs_cis":
            continue
        if key in _TOP_LEVEL:
            hf[_TOP_LEVEL[key]] = value
            continue
        m = _OURS_LAYER.match(key)
        if m is None or m.group(2) not in _PER_LAYER:
            raise KeyError(f"no Hugging Face name for {key!r}")
        layer, name = m.groups()
        if name == "attention.wq.weight":
            value = _interleaved_to_halves(value, args.n_heads)
        elif name == "attention.wk.weight":
            value = _interleaved_to_halves(value, args.n_kv_heads)
        hf[f"model.layers.{layer}.{_PER_LAYER[name]}"] = value
    return hf


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> ours (the inverse of ``to_hf_state_dict``)."""
    top = {v: k for k, v in _TOP_LEVEL.items()}
    per_layer = {v: k for k, v in _PER_LAYER.items()}
    sd = {}
    for key, value in hf_sd.items():
        if key.endswith("rotary_emb.inv_freq"):  # a buffer some older HF checkpoints carry
            continue
        if key in top:
            sd[top[key]] = value
            continue
        m = _HF_LAYER.match(key)
        if m is None or m.group(2) not in per_layer:
            raise KeyError(f"unexpected Hugging Face key {key!r}")
        layer, hf_name = m.groups()
        name = per_layer[hf_name]
        if name == "attention.wq.weight":
            value = _halves_to_interleaved(value, args.n_heads)
        elif name == "attention.wk.weight":
            value = _halves_to_interleaved(value, args.n_kv_heads)
        sd[f"layers.{layer}.{name}"] = value
    return sd


def _transformers_uses_rope_parameters() -> bool:
    """transformers >= 5 configures RoPE with ``rope_parameters`` (theta inside); 4.x with
    ``rope_theta`` + ``rope_scaling``. Without transformers installed, write the 5.x form."""
    try:
        from transformers import LlamaConfig  # local: optional (test extra), seconds to import
    except ImportError:
        return True
    return "rope_parameters" in getattr(LlamaConfig, "__annotations__", {}) or hasattr(LlamaConfig(), "rope_parameters")


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig(**d)`` (the installed version's form)."""
    d: dict[str, Any] = {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    scaling = None
    if args.rope_scaling:
        scaling = {
            "rope_type": "llama3",
            "factor": ROPE_SCALING_FACTOR,
            "low_freq_factor": ROPE_LOW_FREQ_FACTOR,
            "high_freq_factor": ROPE_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    if _transformers_uses_rope_parameters():
        d["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta}
    else:
        d["rope_theta"] = args.rope_theta
        d["rope_scaling"] = scaling
    return d


def args_from_hf_config(cfg: dict[str, Any], **overrides) -> ModelArgs:
    """ModelArgs from a ``config.json`` dict of a Llama checkpoint (either transformers form).

    HF stores the FFN hidden size, not Meta's (multiplier, multiple_of); we set
    ``multiple_of = intermediate_size`` and no multiplier, which reproduces the size exactly
    whenever it is at least ``int(8 * dim / 3)`` (true for every Llama 3 model).
    """
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    args = ModelArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        multiple_of=cfg["intermediate_size"],
        ffn_dim_multiplier=None,
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=rope_type == "llama3",
        rope_original_max_seq_len=rope.get("original_max_position_embeddings", 8192),
        max_seq_len=cfg.get("max_position_embeddings", 8192),
        **overrides,
    )
    if args.ffn_hidden_dim != cfg["intermediate_size"]:
        raise ValueError("cannot express intermediate_size with Meta's FFN sizing rule")
    if rope_type == "llama3":
        published = (ROPE_SCALING_FACTOR, ROPE_LOW_FREQ_FACTOR, ROPE_HIGH_FREQ_FACTOR)
        got = (rope.get("factor"), rope.get("low_freq_factor"), rope.get("high_freq_factor"))
        if tuple(float(x) for x in got) != published:
            raise ValueError(f"llama3 RoPE scaling {got} differs from the published {published}")
    return args


def save_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, folder: str) -> None:
    """Write ``model.safetensors`` and ``config.json`` loadable by ``LlamaForCausalLM.from_pretrained``."""
    from safetensors.torch import save_file  # local: optional dependency (test extra)

    os.makedirs(folder, exist_ok=True)
    hf = {k: v.detach().contiguous().cpu() for k, v in to_hf_state_dict(state_dict, args).items()}
    dtypes = {v.dtype for v in hf.values()}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32",
        **hf_config(args),
        # Our exact ModelArgs, so load_hf round-trips (HF ignores the extra key).
        "titan_model_args": dataclasses.asdict(args),
    }
    save_file(hf, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_hf(folder: str) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Read a folder written by ``save_hf`` (or a single-file HF Llama checkpoint) -> (our state
    dict, ModelArgs)."""
    from safetensors.torch import load_file  # local: optional dependency (test extra)

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    args = ModelArgs(**cfg["titan_model_args"]) if "titan_model_args" in cfg else args_from_hf_config(cfg)
    hf_sd = load_file(os.path.join(folder, "model.safetensors"))
    return from_hf_state_dict(hf_sd, args), args
