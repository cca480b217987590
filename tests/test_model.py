"""Llama 3.1 model: published sizes, meta-device init, parity with transformers, stage forward."""

import dataclasses
from pathlib import Path

import pytest
import torch

from core.config import load_config
from core.metrics import cpu_model, device_info
from core.models.args import model_args, param_count, shape_record
from core.models.hf_convert import from_hf_state_dict, hf_config, load_hf, save_hf, to_hf_state_dict
from core.models.llama3 import FLAVORS, ModelArgs, Transformer, count_params, create_model, precompute_freqs_cis

pytestmark = pytest.mark.core


# Exact counts of the published models (the analytic formula below; 8.03e9 / 70.55e9 / 405.85e9).
PUBLISHED = {"8B": 8_030_261_248, "70B": 70_553_706_496, "405B": 405_853_388_800}


@pytest.mark.parametrize("flavor,rounded", [("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9)])
def test_published_param_counts(flavor, rounded):
    n = count_params(flavor)
    assert n == PUBLISHED[flavor]
    assert abs(n - rounded) / rounded < 1e-3
    assert count_params(flavor, exclude_embedding=True) == n - 128256 * FLAVORS[flavor].dim


def test_ffn_hidden_dims():
    assert [FLAVORS[f].ffn_hidden_dim for f in ("8B", "70B", "405B")] == [14336, 28672, 53248]


def test_meta_model_counts_match_analytic():
    # The whole 8B on meta costs no memory; a module count must equal the analytic one.
    model = create_model("8B", max_seq_len=8192)
    assert next(model.parameters()).is_meta
    assert count_params(model) == PUBLISHED["8B"]
    assert count_params(model, exclude_embedding=True) == count_params("8B", exclude_embedding=True)
    for flavor in ("tiny", "tiny4", "debug", "small"):
        assert count_params(create_model(flavor)) == count_params(flavor)


def test_flavor_copies_are_independent():
    a = create_model("tiny", vocab_size=1000).args
    assert a.vocab_size == 1000 and FLAVORS["tiny"].vocab_size == 4352


def test_model_args_from_the_job_config():
    """core.models.args.model_args: proxy flavors follow the tokenizer, published ones keep Llama 3's
    vocabulary; model.vocab_size and model.rope_scaling override; RoPE table one sequence long."""
    cfg = load_config(overrides=["model.flavor=tiny", "training.seq_len=96"])
    a = model_args(cfg, 1000)
    assert (a.vocab_size, a.max_seq_len, a.rope_scaling) == (1000, 96, False)
    assert model_args(cfg, None).vocab_size == FLAVORS["tiny"].vocab_size
    assert FLAVORS["tiny"].max_seq_len == 512  # the table is not touched
    cfg = load_config(overrides=["model.flavor=8B", "model.rope_scaling=off"])
    a = model_args(cfg, 1000)
    assert (a.vocab_size, a.rope_scaling) == (128256, False)
    cfg = load_config(overrides=["model.flavor=tiny", "model.vocab_size=777", "model.rope_scaling=on"])
    a = model_args(cfg, 1000)
    assert (a.vocab_size, a.rope_scaling) == (777, True)
    assert param_count(a) == count_params(create_model(a))


def test_model_shape_from_the_job_config():
    """model.dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of override the flavor
    (0 keeps it); the module built from the args has the analytic parameter count."""
    cfg = load_config(
        overrides=[
            "model.flavor=debug",
            "model.dim=128",
            "model.n_layers=3",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.ffn_dim_multiplier=1.3",
            "model.multiple_of=64",
        ]
    )
    a = model_args(cfg, 1000)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (128, 3, 4, 2, 1000)
    assert a.ffn_hidden_dim == 448  # int(1.3 * 341) = 443 -> multiple of 64
    assert model_args(load_config(overrides=["model.n_layers=2"]), None).dim == FLAVORS["debug"].dim
    assert FLAVORS["debug"].n_layers == 6  # the table is not touched
    model = create_model(a)
    assert len(model.layers) == 3 and param_count(a) == count_params(model)
    assert shape_record(a)["param_count"] == param_count(a) and shape_record(a)["ffn_hidden_dim"] == 448


def _materialize(flavor, seed):
    torch.manual_seed(seed)
    model = create_model(flavor, max_seq_len=64)  # meta
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    return model


def test_meta_init_deterministic_and_seeded():
    a, b, c = _materialize("tiny", 0), _materialize("tiny", 0), _materialize("tiny", 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.isfinite(sa[k]).all(), k
        assert torch.equal(sa[k], sb[k]), k
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    assert torch.equal(a.freqs_cis, precompute_freqs_cis(a.args))
    # The init recipe: unit-variance embeddings, unit norms, depth-scaled output projections.
    assert abs(sa["tok_embeddings.weight"].std().item() - 1.0) < 0.05
    assert torch.equal(sa["norm.weight"], torch.ones(64))
    wo0, wo1 = sa["layers.0.attention.wo.weight"].std(), sa["layers.1.attention.wo.weight"].std()
    assert abs(wo0 / 0.02 * 2**0.5 - 1) < 0.1 and abs(wo1 / 0.02 * 4**0.5 - 1) < 0.1
    out = sa["output.weight"]
    assert out.abs().max() <= 3 * 64**-0.5
    # A forward pass gives finite logits of the right shape.
    logits = a(torch.randint(0, a.args.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, a.args.vocab_size) and torch.isfinite(logits).all()


# A small model where Llama 3.1 scaling matters: head_dim 16 with theta 5e5 has wavelengths
# 6.3, 32.6, 167, ... tokens; an original context of 64 puts them in all three scaling bands
# (kept, blended, divided by 8) and a 96-token input runs past it.
PARITY_ARGS = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    multiple_of=32,
    ffn_dim_multiplier=1.3,
    rope_theta=500000.0,
    rope_original_max_seq_len=64,
    max_seq_len=128,
)


@pytest.mark.parametrize("rope_scaling", [True, False])
def test_logits_match_transformers(rope_scaling):
    transformers = pytest.importorskip("transformers")
    args = dataclasses.replace(PARITY_ARGS, rope_scaling=rope_scaling)
    if rope_scaling:
        assert not torch.equal(
            precompute_freqs_cis(args), precompute_freqs_cis(dataclasses.replace(args, rope_scaling=False))
        )
    torch.manual_seed(0)
    ours = create_model(args, device="cpu").eval()
    with torch.no_grad():  # sharpen attention so positions (RoPE layout, scaling) really matter
        for layer in ours.layers.values():
            layer.attention.wq.weight.normal_(0, 0.2)
            layer.attention.wk.weight.normal_(0, 0.2)
    sd = ours.state_dict()

    hf_sd = to_hf_state_dict(sd, args)
    back = from_hf_state_dict(hf_sd, args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    config = transformers.LlamaConfig(**hf_config(args))
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)

    tokens = torch.randint(0, args.vocab_size, (2, 96))
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
        got = ours(tokens)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5

    # Negative controls: the same weights under the other RoPE scaling setting, or without the
    # q/k permutation, give visibly different logits.
    other = dataclasses.replace(args, rope_scaling=not rope_scaling)
    hf_other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(other))).eval()
    hf_other.load_state_dict(hf_sd, strict=False)
    unpermuted = dict(hf_sd)
    for i in range(args.n_layers):
        unpermuted[f"model.layers.{i}.self_attn.q_proj.weight"] = sd[f"layers.{i}.attention.wq.weight"]
        unpermuted[f"model.layers.{i}.self_attn.k_proj.weight"] = sd[f"layers.{i}.attention.wk.weight"]
    hf.load_state_dict(unpermuted, strict=False)
    with torch.no_grad():
        assert (hf_other(input_ids=tokens).logits - got).abs().max().item() > 1e-3
        assert (hf(input_ids=tokens).logits - got).abs().max().item() > 1e-3


def test_save_load_hf_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = dataclasses.replace(PARITY_ARGS, rope_scaling=True)
    torch.manual_seed(0)
    ours = create_model(args, device="cpu").eval()
    save_hf(ours.state_dict(), args, str(tmp_path))
    sd, loaded_args = load_hf(str(tmp_path))
    assert loaded_args == args
    assert all(torch.equal(sd[k], v) for k, v in ours.state_dict().items())
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = torch.randint(0, args.vocab_size, (1, 80))
    with torch.no_grad():
        assert (hf(input_ids=tokens).logits - ours(tokens)).abs().max().item() < 1e-5


def test_pipeline_stage_forward():
    torch.manual_seed(0)
    full = create_model("tiny4", device="cpu", max_seq_len=64)
    tokens = torch.randint(0, full.args.vocab_size, (2, 32))
    with torch.no_grad():
        expected = full(tokens)

    first = create_model("tiny4", device="cpu", max_seq_len=64)
    last = create_model("tiny4", device="cpu", max_seq_len=64)
    # Split like pipeline parallelism does: delete layers and the ends, keep the FQNs.
    for i in ("2", "3"):
        del first.layers[i]
    for i in ("0", "1"):
        del last.layers[i]
    first.norm, first.output, last.tok_embeddings = None, None, None
    first.load_state_dict({k: v for k, v in full.state_dict().items() if k in first.state_dict()})
    last.load_state_dict({k: v for k, v in full.state_dict().items() if k in last.state_dict()})
    assert list(last.layers.keys()) == ["2", "3"]
    assert "layers.3.attention.wq.weight" in last.state_dict()

    with torch.no_grad():
        h = first(tokens)
        assert h.shape == (2, 32, 64)
        logits = last(h)
    assert logits.shape == (2, 32, full.args.vocab_size)
    assert torch.equal(logits, expected)

    # A stage built on meta materialises with its own init_weights.
    with torch.device("meta"):
        stage = Transformer(create_model("tiny4").args)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights()
    assert count_params(stage) == count_params("tiny4") - 4352 * 64 - count_params(full.layers["0"])
    assert all(torch.isfinite(p).all() for p in stage.parameters())
    assert stage(torch.randn(1, 8, 64)).shape == (1, 8, 4352)


def test_dtype_cast_of_rope_buffer_is_caught():
    model = create_model("tiny", device="cpu", max_seq_len=16)
    with pytest.warns(UserWarning):  # torch: casting complex to real discards the imaginary part
        model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="freqs_cis"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_cpu_figures_name_their_cpu():
    """A CPU record says which CPU made it: model name and matmul ISA (bf16 matmuls differ tens of
    times between AMX, AVX-512 and AVX2)."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: on a GPU the record names the GPU")
    model = cpu_model()
    assert model.endswith((", AMX", "no AMX")) and len(model) > len(", no AMX")
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "").split()
    if "avx512f" in flags and "amx_bf16" not in flags:
        assert ", AVX-512" in model
    elif "avx2" in flags and "avx512f" not in flags:
        assert ", AVX2, no AVX-512, no AMX" in model
    assert device_info()["device"].startswith(f"cpu ({model}, ")


def test_attention_dtype_resolves_per_device_and_keeps_the_output():
    """auto: fp32 attention on CPU only; the fp32 kernel under bf16 autocast returns bf16 and
    agrees with the bf16 kernel to bf16 rounding."""
    from core.build import with_attention_dtype

    cfg = load_config(None, ["model.flavor=tiny"])
    args = model_args(cfg, 1000)
    assert with_attention_dtype(args, cfg, torch.device("cpu")).attention_fp32
    assert not with_attention_dtype(args, cfg, torch.device("meta")).attention_fp32
    forced = load_config(None, ["model.flavor=tiny", "model.attention_dtype=float32"])
    assert with_attention_dtype(args, forced, torch.device("meta")).attention_fp32
    compute = load_config(None, ["model.flavor=tiny", "model.attention_dtype=compute"])
    assert not with_attention_dtype(args, compute, torch.device("cpu")).attention_fp32

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(args, max_seq_len=64))
    model.init_weights()
    tokens = torch.randint(0, 1000, (2, 64))
    outs = {}
    for fp32 in (False, True):
        for block in model.layers.values():
            block.attention.inner_attention.fp32 = fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[fp32] = model(tokens)
    assert outs[True].dtype == torch.float32  # the model's logits are fp32 either way
    assert not torch.equal(outs[True], outs[False])  # a different kernel ran
    assert (outs[True] - outs[False]).abs().max() < 0.05 * outs[False].abs().max()
