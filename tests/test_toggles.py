"""Training-efficiency toggles: activation checkpointing, regional compile,
Float8, AsyncTP. Single-process tests build the real Trainer in this process (world 1, a
one-rank gloo group); multi-process ones launch it under torchrun (marked slow)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from core import cpu_gemm
from core.config import ActivationCheckpoint, Compile, ConfigError, load_config
from core.hardware import check_toggle_hardware
from core.models.llama3 import create_model
from core.parallel.parallelize import Toggles
from core.reference import reference_run
from core.toggles import compile as compile_mod
from core.toggles import group_roles
from core.toggles.activation_checkpoint import apply_ac, wrap_block
from core.toggles.compile import compile_block
from core.toggles.float8 import apply_float8, post_optimizer_hook
from core.train import Trainer, init_distributed
from core.validate import validate
from recipes import modes
from recipes.studies.parity_layouts import FLOAT8_TOLERANCE  # the parity suite's, justified there
from tests.dist_utils import GROUPS, ROOT, TINY_JOB, max_abs_diff, run_trainer

pytestmark = [pytest.mark.toggles]

BASE = [
    "model.flavor=tiny",
    "data.dataset=synthetic",
    "training.seq_len=64",
    "training.local_batch_size=8",
    "optimizer.lr=1e-3",
    "lr_scheduler.warmup_steps=2",
    "metrics.progress=false",
]
AC_OVERRIDES = {
    "ac:full": ["activation_checkpoint.mode=full"],
    "ac:op": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option='op'"],
    "ac:layer2": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option='2'"],
}


def cfg_of(*overrides, steps=5, out=None):
    extra = [f"job.output_dir={out}"] if out else []
    return validate(load_config(None, BASE + [f"training.steps={steps}", *extra, *overrides]), 1, check_files=False)


@pytest.fixture(scope="module")
def pg():
    """A one-rank process group for in-process Trainers (kept if one already exists)."""
    created = not dist.is_initialized()
    if created:
        init_distributed(cfg_of())
    yield
    if created:
        dist.destroy_process_group()


def train(out, *overrides, steps=5) -> dict:
    return Trainer(cfg_of(*overrides, steps=steps, out=out)).train()


def tiny_model(flavor="tiny4", vocab=512, seq=64):
    torch.manual_seed(0)
    return create_model(flavor, vocab_size=vocab, max_seq_len=seq, device="cpu")


# ------------------------------------------------------------------------- activation checkpointing
def test_ac_modes_match_no_ac(pg, tmp_path):
    """fp32: recomputation must not change a single loss (no dropout, same kernels)."""
    base = train(tmp_path / "none")
    assert not [t for t in base["toggles_applied"] if t.startswith("ac:")]
    assert base["losses"][-1] < base["losses"][0] - 0.05  # it learns, so equality means something
    for name, overrides in AC_OVERRIDES.items():
        rec = train(tmp_path / name.replace(":", "_"), *overrides)
        assert name in rec["toggles_applied"], rec["toggles_applied"]
        assert max_abs_diff(rec["losses"], base["losses"]) <= 1e-6, (name, rec["losses"], base["losses"])


def test_ac_wraps_the_right_blocks():

    for option, wrapped in (("1", ["0", "1", "2", "3"]), ("2", ["1", "3"]), ("3", ["2"]), ("op", ["0", "1", "2", "3"])):
        model, toggles = tiny_model(), Toggles()
        apply_ac(model, ActivationCheckpoint("selective", option), toggles)
        got = [n for n, b in model.layers.named_children() if isinstance(b, CheckpointWrapper)]
        assert got == wrapped, (option, got)
        assert toggles.applied == [f"ac:{'op' if option == 'op' else 'layer' + option}"]
    model = tiny_model()
    apply_ac(model, ActivationCheckpoint("none"), Toggles())
    assert not any(isinstance(b, CheckpointWrapper) for b in model.layers.values())


def activation_peak_mib(mode: str, option: str = "op") -> float:
    """Peak activation memory of one forward + backward (MemTracker: tensors by role)."""

    model = tiny_model(seq=256)
    apply_ac(model, ActivationCheckpoint(mode, option), Toggles())
    tokens = torch.randint(0, 512, (4, 257), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1)).backward()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(v[_MemRefType.ACT] for v in peak.values()) / 2**20


def test_full_ac_cuts_activation_memory_by_more_than_half():
    none, full = activation_peak_mib("none"), activation_peak_mib("full")
    op = activation_peak_mib("selective", "op")
    assert full < 0.5 * none, (full, none)
    assert full < op < none, (full, op, none)  # op AC keeps the matmul outputs, recomputes the rest


# ---------------------------------------------------------------------------------------- compile
def test_compile_matches_eager_and_reuses_one_graph(pg, tmp_path):
    from torch._dynamo.utils import counters  # ~1.5 s import: this test only

    eager = train(tmp_path / "eager", "model.flavor=tiny4", steps=4)
    frames_before = counters["stats"]["unique_graphs"]
    compiled = train(tmp_path / "compiled", "compile.enabled=true", "model.flavor=tiny4", steps=4)
    assert "compile" in compiled["toggles_applied"] and "compile" not in eager["toggles_applied"]
    assert max_abs_diff(compiled["losses"], eager["losses"]) < 1e-5, (compiled["losses"], eager["losses"])
    # four identical blocks, one forward graph: the blocks share the compiled code
    assert counters["stats"]["unique_graphs"] - frames_before == 1


@pytest.mark.slow  # a cold compile of the second job's graph
def test_a_later_job_of_the_process_compiles_as_a_new_process_would(pg, tmp_path):
    """run_jobs and the group worker run jobs one after another in one process. Each starts with
    Dynamo reset: a compiled job after another on other shapes builds its own static graph, as its
    own run would, instead of recompiling the block with a dynamic batch (a RecompileError here)."""
    from core.train import run

    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (8, 4):  # 8: the graph test_compile_matches_eager's job compiles
            overrides = ("compile.enabled=true", "model.flavor=tiny4", f"training.local_batch_size={batch}")
            rec = run(cfg_of(*overrides, steps=1, out=tmp_path / f"batch{batch}"))
            assert "compile" in rec["toggles_applied"] and len(rec["losses"]) == 1


def test_full_ac_stays_outside_compile_on_tp_blocks(pg):
    """Full AC around a block holding DTensors (TP): checkpoint eager, the block compiled inside;
    otherwise (plain block, or op SAC) the checkpoint is compiled with the block."""

    mesh = init_device_mesh("cpu", (1,))
    plain, tp_block = tiny_model().layers["0"], tiny_model().layers["0"]
    wq = tp_block.attention.wq
    wq.weight = torch.nn.Parameter(distribute_tensor(wq.weight.detach(), mesh, [Replicate()]))
    out = compile_block(wrap_block(tp_block, "full"), Compile(enabled=True))
    compiled = torch._dynamo.eval_frame.OptimizedModule
    assert isinstance(out, CheckpointWrapper) and isinstance(out._checkpoint_wrapped_module, compiled)
    for block in (wrap_block(plain, "full"), wrap_block(tp_block, "op")):
        out = compile_block(block, Compile(enabled=True))
        assert isinstance(out, compiled) and isinstance(out._orig_mod, CheckpointWrapper)


def test_compile_uses_the_project_cache_dir(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_mod.ensure_cache_dir() == str(compile_mod.DEFAULT_CACHE_DIR)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere-inductor")
    assert compile_mod.ensure_cache_dir() == "/tmp/elsewhere-inductor"  # a caller's choice is kept
    # torch's first cache lookup (at some imports) sets its own default: that is no caller's choice
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    cache_dir()
    assert compile_mod.ensure_cache_dir() == str(compile_mod.DEFAULT_CACHE_DIR)


ISA_PICK = """
import sys, threading
from torch._inductor import cpu_vec_isa
from core.toggles.compile import probe_cpu_isas_in_background
started = 0
if sys.argv[1] == "background":
    probe_cpu_isas_in_background()
    probes = [t for t in threading.enumerate() if t.name.startswith("isa-probe-")]
    started = len(probes)
    for t in probes:
        t.join()
builds = []
check_build = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda self, code: builds.append(code) or check_build(self, code)
print(str(cpu_vec_isa.pick_vec_isa()), [str(i) for i in cpu_vec_isa.valid_vec_isa_list()], started, len(builds))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA probes run on x86 CPUs")
def test_cpu_isa_probes_run_in_background_and_pick_what_inductor_picks():
    """The probes inductor runs one after another at the first compile run in threads started
    with compile (core.toggles.compile): inductor then builds nothing more, and picks the ISA it
    picks alone. The project's cache: cold on a fresh machine, and `check_build` runs either way."""
    env = modes.PROXY.env(1)
    procs = {
        how: subprocess.Popen(
            [sys.executable, "-c", ISA_PICK, how], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        for how in ("background", "inductor")
    }
    out = {how: p.communicate(timeout=300)[0].strip().splitlines()[-1] for how, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), out
    background, alone = (out[h].rsplit(" ", 2) for h in ("background", "inductor"))
    assert background[0] == alone[0], out  # the ISA picked and the valid list
    assert int(background[1]) >= 1 and int(background[2]) == 0, out  # threads started; nothing built after
    assert int(alone[2]) >= 1, out  # without them inductor builds its probes itself


def test_group_names_are_written_by_role_in_keys_and_saved_code():
    """Ranks of different TP groups share a graph: registered group names become their role in
    op calls, and loading puts this process's group back. A name left anywhere else (not an op
    argument) keeps the code raw, so nothing is shared wrongly."""
    code = (
        "buf2 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf1, 2, '27')\n"
        "torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '41')\n"
        "x = foo('27')  # not an op call\n"
    )
    try:
        group_roles.name_groups({"tp": "27", "cp": "41", "dp_cp": "41"})  # dp_cp is cp's group here
        assert group_roles.canonical_code(code) is None  # '27' outside an op call
        ops = code.rsplit("x = ", 1)[0]
        by_role = group_roles.canonical_code(ops)
        assert "'titan-group:tp'" in by_role and "'titan-group:cp'" in by_role and "dp_cp" not in by_role
        assert "'27'" not in by_role and "'41'" not in by_role and "'sum'" in by_role
        group_roles.name_groups({"tp": "28", "cp": "43"})  # a rank of other groups loads it
        assert group_roles.local_code(by_role) == ops.replace("'27'", "'28'").replace("'41'", "'43'")
        group_roles.name_groups({"tp": "28"})
        with pytest.raises(RuntimeError, match="'cp'"):
            group_roles.local_code(by_role)
    finally:
        group_roles.name_groups({})
    assert group_roles.canonical_code(code) == code  # no groups registered: code as it is


@pytest.mark.slow
def test_ranks_of_two_tp_groups_share_compiles_and_a_warm_rerun_loads_its_own_groups(tmp_path):
    """TP 2 x DP 2, cold: the four ranks start each compile at once and one compiles it for all
    of them, across the two TP groups (torch 2.13 alone: every rank misses, the key changes with
    the process; with a stable key and a lock alone: once per TP group). AOTAutograd traces once
    per TP coordinate, not once per rank: its entry, keyed by the mesh's roles and this rank's
    coordinate, serves the same coordinate of the other TP group, with that rank's own groups and
    mesh (loading the other group's names failed: "Could not resolve the process group")."""
    job = [*_world2_job(2), "--parallelism.dp_shard=2", "--parallelism.tp=2", "--compile.enabled=true"]
    job = [o for o in job if "training.steps" not in o] + ["--training.steps=3"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cold = run_trainer(4, job, tmp_path / "cold", env=env)
    assert cold["fxgraph_cache_all_ranks"] == {"hit": 6, "miss": 2, "bypass": 0}, cold  # forward, backward
    assert cold["aot_autograd_cache_all_ranks"] == {"hit": 2, "miss": 2, "bypass": 0}, cold
    warm = run_trainer(4, job, tmp_path / "warm", env=env)
    assert warm["aot_autograd_cache_all_ranks"] == {"hit": 4, "miss": 0, "bypass": 0}, warm
    assert warm["fxgraph_cache_all_ranks"]["miss"] == 0
    assert warm["losses"] == cold["losses"]


def _world2_job(dp: int):
    return [o for o in TINY_JOB if "local_batch_size" not in o] + [f"--training.local_batch_size={8 // dp}"]


@pytest.fixture(scope="module")
def reference_fp32():
    return reference_run(validate(load_config(None, [o.lstrip("-") for o in TINY_JOB]), 1, check_files=False))["losses"]


# One torchrun per world size for the jobs of every module (tests.dist_utils.GROUPS).
GROUPS.add(
    2,
    {
        "toggles.compile_fsdp2": _world2_job(2) + ["--parallelism.dp_shard=2", "--compile.enabled=true"],
        "toggles.compile_tp2_acfull": _world2_job(1)
        + [
            "--parallelism.tp=2",
            "--compile.enabled=true",
            "--activation_checkpoint.mode=full",
            "--parallelism.enable_async_tp=true",
        ],
        "toggles.float8_fsdp2_all_gather": _world2_job(2)
        + [
            "--training.mixed_precision_param=bfloat16",
            "--parallelism.dp_shard=2",
            "--float8.enabled=true",
            "--float8.enable_fsdp_float8_all_gather=true",
            "--float8.precompute_float8_dynamic_scale_for_fsdp=true",
        ],
    },
)


@pytest.mark.slow
def test_compile_composes_with_fsdp2(tmp_path_factory, reference_fp32):
    rec = GROUPS.get("toggles.compile_fsdp2", tmp_path_factory)
    assert rec["hardware"]["bf16_gemm"] == "native"  # fp32 training leaves torch's kernels alone
    assert {"compile", "fsdp"} <= set(rec["toggles_applied"])
    assert rec["compile_shared_cache"] is True  # compile.shared_cache=auto on CPU ranks
    assert max_abs_diff(rec["losses"], reference_fp32) < 1e-5


@pytest.mark.slow
def test_compile_composes_with_tp_and_async_tp_is_skipped_on_cpu(tmp_path_factory, reference_fp32):
    """The two cases torch 2.13 broke, fixed in core.toggles.compile: per-block compile with TP 2
    ('Tensor' object has no attribute '_local_tensor'), and with full AC on top (AOTAutograd
    saving a DeviceMesh). AsyncTP asked for in proxy mode: recorded as skipped, with the reason."""
    rec = GROUPS.get("toggles.compile_tp2_acfull", tmp_path_factory)
    assert {"compile", "tp", "ac:full"} <= set(rec["toggles_applied"])
    assert max_abs_diff(rec["losses"], reference_fp32) < 1e-5
    cache = rec["fxgraph_cache_all_ranks"]  # the two ranks of the TP group share each compiled graph
    assert cache["hit"] >= cache["miss"] and cache["hit"] + cache["miss"] >= 4, cache
    assert "async_tp" not in rec["toggles_applied"]
    assert "CUDA" in rec["toggles_skipped"]["async_tp"] and "NVSwitch" in rec["toggles_skipped"]["async_tp"]


# ----------------------------------------------------------------------------------------- float8
BF16 = ["training.mixed_precision_param=bfloat16"]


@pytest.fixture(scope="module")
def bf16_losses(pg, tmp_path_factory):
    return train(tmp_path_factory.mktemp("bf16"), *BF16, steps=10)["losses"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_close_to_bf16(bf16_losses, tmp_path, recipe):
    """10 steps of bf16 autocast (no FSDP) with and without float8 linears. rowwise_with_gw_hp
    is the combination torchao's eager Float8Linear failed in (bf16 grad x fp32 input)."""
    rec = train(tmp_path, *BF16, "float8.enabled=true", f"float8.recipe={recipe}", steps=10)
    assert {"float8", f"float8:{recipe}"} <= set(rec["toggles_applied"])
    assert max_abs_diff(rec["losses"], bf16_losses) < 5e-3
    assert rec["losses"] != bf16_losses  # float8 really ran


def test_float8_filter_keeps_output_and_odd_dims_high_precision():
    from torchao.float8.float8_linear import Float8Linear  # torchao only where Float8 is tested

    model = tiny_model()
    model.layers["0"].feed_forward.w2 = torch.nn.Linear(200, 64, bias=False)  # 200 % 16 != 0
    cfg = cfg_of("float8.enabled=true")
    toggles = Toggles()
    apply_float8(model, cfg, toggles)
    assert not isinstance(model.output, Float8Linear)
    assert not isinstance(model.layers["0"].feed_forward.w2, Float8Linear)
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert isinstance(model.layers["1"].feed_forward.w2, Float8Linear)
    assert toggles.applied == ["float8", "float8:tensorwise"]


def test_float8_emulation_matches_the_scaled_mm_kernel():
    """The proxy's emulated float8 (fp32 matmul of the same float8-quantized operands) against
    torch._scaled_mm on CPU: equal up to accumulation order, and the record says emulated."""
    torch.manual_seed(0)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    outs, grads = {}, {}
    for emulate in (False, True):
        lin = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
        torch.manual_seed(1)
        torch.nn.init.normal_(lin[0].weight)
        toggles = Toggles()
        apply_float8(lin, cfg_of("float8.enabled=true", f"float8.emulate={str(emulate).lower()}"), toggles)
        assert ("float8:emulated" in toggles.applied) == emulate
        xi = x.clone().requires_grad_()
        out = lin(xi)
        out.float().square().sum().backward()
        outs[emulate], grads[emulate] = out.float(), xi.grad.float()
    ref = x.float() @ lin[0].weight.float().t()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(outs[True], outs[False]) < 1e-4  # measured 7e-7: accumulation order only
    assert rel(grads[True], grads[False]) < 1e-4
    assert 1e-3 < rel(outs[True], ref) < 0.1  # both really quantized to float8


def test_float8_fsdp_options_validated():
    with pytest.raises(ConfigError, match="float8.enable_fsdp_float8_all_gather"):
        cfg_of("float8.enabled=true", "float8.recipe=rowwise", "float8.enable_fsdp_float8_all_gather=true")
    with pytest.raises(ConfigError, match="float8.precompute_float8_dynamic_scale_for_fsdp"):
        cfg_of("float8.enabled=true", "float8.precompute_float8_dynamic_scale_for_fsdp=true")
    on = [
        "float8.enabled=true",
        "float8.enable_fsdp_float8_all_gather=true",
        "float8.precompute_float8_dynamic_scale_for_fsdp=true",
    ]
    fsdp2 = validate(load_config(None, BASE + on + ["parallelism.dp_shard=2"]), 2, check_files=False)
    assert callable(post_optimizer_hook(fsdp2))
    assert post_optimizer_hook(cfg_of(*on)) is None  # no FSDP at world 1: nothing to precompute


@pytest.mark.slow
def test_float8_fsdp2_float8_all_gather(tmp_path_factory):
    bf16 = ["--training.mixed_precision_param=bfloat16"]
    ref = reference_run(validate(load_config(None, [o.lstrip("-") for o in TINY_JOB + bf16]), 1, check_files=False))[
        "losses"
    ]
    rec = GROUPS.get("toggles.float8_fsdp2_all_gather", tmp_path_factory)
    assert {"float8", "float8:tensorwise", "float8_fsdp_all_gather", "fsdp"} <= set(rec["toggles_applied"])
    assert max_abs_diff(rec["losses"], ref) < FLOAT8_TOLERANCE
    # bf16 training: the ranks route bf16 matmuls as this CPU needs (core.cpu_gemm), as the reference did
    assert rec["hardware"]["bf16_gemm"] == cpu_gemm.resolve("auto", torch.device("cpu"), "bfloat16")


def test_float8_needs_sm89_on_cuda(monkeypatch):
    cfg = cfg_of("float8.enabled=true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match="float8.enabled: .*sm89.*sm80"):
        check_toggle_hardware(cfg)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert check_toggle_hardware(cfg) == {}


@pytest.mark.parametrize(("arch", "ok"), [("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx90a", False)])
def test_float8_on_rocm_needs_an_fp8_part_not_a_gfx_version(monkeypatch, arch, ok):
    """ROCm reports a GFX version as the capability ((9, 0) for the MI250X, which has no FP8):
    the check reads the part's LLVM target instead (gfx942: MI300X/MI325X, gfx950: MI350X/MI355X)."""
    cfg = cfg_of("float8.enabled=true")
    props = type("Props", (), {"gcnArchName": arch})()
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "AMD Instinct")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    if ok:
        assert check_toggle_hardware(cfg) == {}
    else:
        with pytest.raises(ConfigError, match="float8.enabled: .*gfx942 or gfx950.*gfx90a"):
            check_toggle_hardware(cfg)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with compute capability >= sm89 (float8 matmuls)",
)
def test_float8_on_cuda(pg, tmp_path):
    rec = train(tmp_path, *BF16, "float8.enabled=true", steps=3)
    assert "float8" in rec["toggles_applied"]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_rowwise_float8_under_compile_emulates_precision_casts(pg, recipe):
    """torchtitan turns inductor's emulate_precision_casts on for rowwise Float8 (NaNs with compile
    and recompute otherwise: pytorch/pytorch#150859); the record says so among the toggles."""
    import torch._inductor.config as inductor_config

    from core.parallel.mesh import ParallelDims
    from core.parallel.parallelize import parallelize

    cfg = cfg_of("float8.enabled=true", f"float8.recipe='{recipe}'", "float8.emulate=true", "compile.enabled=true")
    dims = ParallelDims(1, 1, 1, 1, 1, 1)
    toggles = Toggles()
    with inductor_config.patch(emulate_precision_casts=False):  # process-wide: restored after
        parallelize(tiny_model(), dims.build_mesh("cpu"), dims, cfg, toggles)
        casts = inductor_config.emulate_precision_casts
    rowwise = recipe == "rowwise"
    assert casts is rowwise
    assert ("compile:emulate_precision_casts" in toggles.applied) is rowwise, toggles.applied
