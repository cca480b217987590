"""FSDP in the performance model and the accounting: the reshard policy (core/parallel/reshard.py)
and what FSDP2 copies on the compute stream (core/dryrun/fsdp_cost.py)."""

from __future__ import annotations

import pytest

from core.dryrun import gpuspec as G
from core.dryrun.runtime import predict
from recipes import registry

NO_MEM = {"allocated_peak_gib": 0.0}


def cfg_with(rid: str, *overrides: str):
    return registry.resolve_config(registry.get(rid), "dry-run", list(overrides))


def test_reshard_policy_keeps_what_it_does_not_gather_again():
    """default reshards every block but the last (and the root), always all, never none (PP:
    default keeps all); a block kept from forward to backward holds its unsharded parameters
    through the loss (`never` at 8B x 8 adds the 31 other blocks' bf16 weights, and the root
    when the torch of the run did not keep it anyway) and skips its backward all-gather."""
    from core.dryrun.memory import GIB, estimate_memory, stage_params
    from core.dryrun.stack import THIS_TRAINER, Stack
    from core.models.args import model_args
    from core.parallel.reshard import reshard_after_forward

    assert reshard_after_forward("default", 4, False) == ([True, True, True, False], True)
    assert reshard_after_forward("always", 4, False) == ([True] * 4, True)
    assert reshard_after_forward("never", 4, False) == ([False] * 4, False)
    assert reshard_after_forward("default", 4, True) == ([False] * 4, False)
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward"):
        reshard_after_forward("sometimes", 4, False)

    def run(policy, stack=THIS_TRAINER):
        c = cfg_with(
            "llama3_8b/table1/8gpu_fsdp",
            "training.local_batch_size=1",
            f'parallelism.fsdp_reshard_after_forward="{policy}"',
        )
        return estimate_memory(c, stack=stack), predict(c, G.DEFAULT_GPU, memory=NO_MEM, stack=stack)

    c = cfg_with("llama3_8b/table1/8gpu_fsdp")
    st = stage_params(model_args(c, None), 32, True, True, 1)
    blk, root = 2 * st.block / GIB, 2 * st.root / GIB
    (dm, dp), (nm, np_), (am, _) = run("default"), run("never"), run("always")
    assert nm["peak_at"] == dm["peak_at"] == "loss backward"
    assert nm["allocated_peak_gib"] - dm["allocated_peak_gib"] == pytest.approx(31 * blk + root, rel=1e-6)
    assert dm["allocated_peak_gib"] - am["allocated_peak_gib"] == pytest.approx(blk, rel=1e-6)
    old = Stack(root_kept_gathered=True)
    assert run("never", old)[0]["allocated_peak_gib"] - run("default", old)[0]["allocated_peak_gib"] == pytest.approx(
        31 * blk, rel=1e-6
    )
    assert np_["step_time_s"] <= dp["step_time_s"]


def test_fsdp_copies_run_on_the_compute_stream_once_per_gather_and_reduce():
    """FSDP2 copies each gathered buffer out into the parameters (2 x its bytes) and each block's
    gradients into the reduce-scatter input (bf16 read, fp32 written), on the compute stream:
    per step a cost that does not shrink with the tokens; `never` skips the backward gathers'."""
    from core.dryrun.fsdp_cost import fsdp_bytes, fsdp_copies
    from core.dryrun.memory import stage_params
    from core.models.args import model_args

    c = cfg_with("llama3_8b/table1/8gpu_fsdp", "training.local_batch_size=1")
    st = stage_params(model_args(c, None), 32, True, True, 1)
    cp = fsdp_copies(c, 1.0, True, st)
    assert cp["ag_block"] == 2 * fsdp_bytes(c, st)["ag_block"] == 4 * st.block
    assert cp["rs_block"] == (2 + 4) * st.block and cp["rs_root"] == 6 * st.root
    assert set(fsdp_copies(c, 1.0, False, st).values()) == {0.0}

    def mb(*o):
        cfg = cfg_with("llama3_8b/table1/8gpu_fsdp", "training.local_batch_size=1", *o)
        return predict(cfg, G.DEFAULT_GPU, memory=NO_MEM)["breakdown"]["memory_bound"]

    spec = G.load_spec(G.DEFAULT_GPU)
    hbm = spec.hbm_bandwidth * spec.hbm
    skipped = 31 * cp["ag_block"] / hbm + cp["ag_root"] / hbm  # the blocks' and the root's backward gathers
    assert mb() - mb('parallelism.fsdp_reshard_after_forward="never"') == pytest.approx(skipped, rel=1e-6)
    short = [mb("training.seq_len=4096") / mb(), mb("training.seq_len=8192") / mb()]
    assert short[0] > 0.5 and short[1] == 1.0  # the copies do not halve with the tokens


def test_float8_all_gather_without_precomputed_scales_reduces_each_weights_amax():
    """With the float8 all-gather, each weight's shard is cast before the gather with a scale
    reduced across the shards: without precomputed scales one small all-reduce per weight per
    gather on FSDP's stream; with them one for all weights after the optimizer step. Without the
    float8 all-gather neither (the bf16 gather carries twice the bytes)."""
    from core.dryrun.comms import mesh_links
    from core.dryrun.fsdp_cost import BLOCK_LINEARS, amax_reduces, fsdp_times
    from core.dryrun.memory import stage_params
    from core.models.args import model_args

    base = ("training.local_batch_size=1", "float8.enabled=true", "float8.enable_fsdp_float8_all_gather=true")
    pre = cfg_with("llama3_8b/table1/8gpu_fsdp_compile", *base, "float8.precompute_float8_dynamic_scale_for_fsdp=true")
    each = cfg_with("llama3_8b/table1/8gpu_fsdp_compile", *base)
    bf16_ag = cfg_with("llama3_8b/table1/8gpu_fsdp_compile", "training.local_batch_size=1", "float8.enabled=true")
    assert (amax_reduces(pre), amax_reduces(each), amax_reduces(bf16_ag)) == (0, BLOCK_LINEARS, 0)
    spec = G.load_spec(G.DEFAULT_GPU)
    links = mesh_links(spec, {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}, ("dp_shard",))
    st = stage_params(model_args(pre, None), 32, True, True, 1)
    t = {name: fsdp_times(c, links, True, 8, st) for name, c in (("pre", pre), ("each", each), ("bf16", bf16_ag))}
    assert t["each"]["ag_block"] - t["pre"]["ag_block"] == pytest.approx(
        BLOCK_LINEARS * links["fsdp"].small_all_reduce()
    )
    assert t["bf16"]["ag_block"] > t["pre"]["ag_block"]  # twice the linears' bytes
    b = {
        n: predict(c, G.DEFAULT_GPU, memory=NO_MEM)["breakdown"]["optimizer"] for n, c in (("pre", pre), ("each", each))
    }
    assert b["pre"] > b["each"]  # the max-norm over the shards after the optimizer step
