"""Pipeline stages built with static shapes (`parallelism.pp_static_shapes`) against torch's dynamic
inference, and the first step's timeout of a compiled pipeline (core.debug.first_step_timeout)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from core import validate as V
from core.config import ConfigError, load_config
from core.debug import COLD_STAGE_COMPILE_S, first_step_timeout
from core.models.args import model_args
from core.parallel.mesh import ParallelDims
from core.parallel.pipeline import activation_dtype, stage_examples
from core.parallel.stages import StageShapes, static_stage_shapes
from core.validate import validate
from recipes import registry
from recipes.studies import parity_layouts as PL
from tests.dist_utils import GROUPS, ROOT, TINY_JOB, dist_env, max_abs_diff, run_trainer, torchrun_command

pytestmark = [pytest.mark.parity]

PP8_ROWS = ("llama3_405b/table3/512gpu_3d_1f1b", "llama3_405b/table3/512gpu_3d_interleaved_1f1b")
STATIC = "--parallelism.pp_static_shapes=true"


def _cfg(*overrides: str, world: int | None = None, check_files: bool = False):
    return validate(load_config(None, [o.lstrip("-") for o in overrides]), world, check_files=check_files)


def _shapes(cfg) -> StageShapes:
    args = model_args(cfg, None)
    return static_stage_shapes(cfg, args.n_layers, args.dim, args.vocab_size)


# ------------------------------------------------------------------------------- unit (fast)
def test_static_shapes_from_the_config():
    # Table 3's row at true scale: 32 sequences in 8 microbatches, seq 8192 over TP 8 (sequence
    # parallel), the 405B's dim 16384 and Llama 3's 128256 tokens sharded over TP 8 (loss parallel)
    cfg = registry.get(PP8_ROWS[0]).job_config("real")
    assert _shapes(validate(cfg, 512, check_files=False)) == StageShapes(
        (4, 8192), (4, 1024, 16384), (4, 8192, 128256), 8
    )
    tiny = [*TINY_JOB, "--model.flavor=tiny4", "--parallelism.pp=2", "--parallelism.pp_microbatches=4"]
    # CP shards the tokens, CP x TP the hidden states; without loss parallel the logits are whole
    cp_tp = _cfg(*tiny, "--parallelism.cp=2", "--parallelism.tp=2", "--parallelism.loss_parallel=false")
    assert _shapes(cp_tp) == StageShapes((2, 32), (2, 16, 64), (2, 32, 4352), 1)
    assert _shapes(_cfg(*tiny)) == StageShapes((2, 64), (2, 64, 64), (2, 64, 4352), 1)


def test_static_shapes_refuse_uneven_shards_naming_the_key(monkeypatch):
    tp_pp = [*TINY_JOB, "--model.flavor=tiny4", "--parallelism.pp=2", "--parallelism.tp=2"]
    cfg = _cfg(*tp_pp, STATIC, world=4)
    with pytest.raises(ConfigError, match=r"parallelism.pp_static_shapes: the vocabulary \(4353 tokens\) over tp 2"):
        static_stage_shapes(cfg, 4, 64, 4353)
    # before launch: validate reads the tokenizer the proxy model's vocabulary follows
    monkeypatch.setattr(V, "_check_tokenizer", lambda cfg: 4353)
    streamed = [o for o in tp_pp if "dataset" not in o] + ["--data.dataset=c4"]
    with pytest.raises(ConfigError, match="parallelism.pp_static_shapes"):
        _cfg(*streamed, STATIC, world=4, check_files=True)
    _cfg(*streamed, world=4, check_files=True)  # torch's dynamic inference handles uneven shards
    _cfg(*streamed, STATIC, "--parallelism.loss_parallel=false", world=4, check_files=True)  # whole logits


def test_activation_dtype_between_stages():
    """bf16 only under FSDP2's bf16 policy: autocast (bf16 without FSDP) keeps the residual stream fp32."""

    def dtype(dp_shard: int, param: str) -> torch.dtype:
        cfg = load_config(None, [f"training.mixed_precision_param={param}"])
        return activation_dtype(cfg, ParallelDims(1, dp_shard, 1, 1, 2, 2 * dp_shard))

    assert dtype(2, "bfloat16") == torch.bfloat16
    assert dtype(1, "bfloat16") == dtype(2, "float32") == dtype(1, "float32") == torch.float32


def test_stage_examples_are_meta_tensors_with_their_gradients():
    shapes = StageShapes((2, 64), (2, 32, 64), (2, 64, 4352), 1)
    first, middle, last = (stage_examples(s, 4, shapes, torch.bfloat16) for s in (0, 1, 3))
    (tokens,), (hidden,) = first["input_args"], first["output_args"]
    assert tokens.dtype == torch.int64 and not tokens.requires_grad and tokens.shape == (2, 64)
    assert hidden.dtype == torch.bfloat16 and hidden.requires_grad and hidden.shape == (2, 32, 64)
    assert first["input_grads"] == (None,) and not first["output_grads"][0].requires_grad
    assert middle["input_args"][0].shape == middle["output_args"][0].shape == (2, 32, 64)
    (logits,) = last["output_args"]
    assert logits.dtype == torch.float32 and logits.shape == (2, 64, 4352) and last["output_grads"] == (None,)
    every = [t for ex in (first, middle, last) for args in ex.values() for t in args if t is not None]
    assert all(t.device.type == "meta" for t in every)  # nothing allocated


# ----------------------------------------------------------------- first step's timeout (fast)
def _pp8_compiled_rows() -> list[str]:
    rows = []
    for recipe in registry.all_recipes():
        cfg = recipe.job_config("real")
        if cfg.parallelism.pp == 8 and cfg.compile.enabled:
            rows.append(recipe.id)
    return rows


def test_the_paper_has_pp8_compiled_rows():
    assert set(PP8_ROWS) <= set(_pp8_compiled_rows())  # and table 5's 405B rows


@pytest.mark.realpath
@pytest.mark.parametrize("row", _pp8_compiled_rows())
@pytest.mark.parametrize("static", [False, True])
def test_first_step_timeout_of_a_pp8_compiled_row(row, static):
    """The goal: the first step of a pp = 8 compiled row may last pp x a cold compile, on top of the
    init timeout, because its ranks compile one after another (with either way of getting shapes)."""
    cfg = registry.get(row).job_config("real")
    cfg.parallelism.pp_static_shapes = static
    seconds, reason = first_step_timeout(cfg)
    assert seconds >= 8 * COLD_STAGE_COMPILE_S
    assert seconds == cfg.comm.init_timeout_seconds + 8 * COLD_STAGE_COMPILE_S == 300 + 960
    assert "pp 8 x 120 s" in reason and ("static" in reason) == static


@pytest.mark.realpath
def test_first_step_timeout_is_the_init_timeout_without_a_compiled_pipeline():
    eager_pp = registry.get(PP8_ROWS[0]).job_config("real")
    eager_pp.compile.enabled = False
    compiled_no_pp = registry.get("llama3_8b/table1/8gpu_fsdp_compile").job_config("real")
    for cfg in (eager_pp, compiled_no_pp):
        assert first_step_timeout(cfg) == (cfg.comm.init_timeout_seconds, "comm.init_timeout_seconds")


@pytest.mark.realpath
def test_init_distributed_applies_the_first_step_timeout(monkeypatch):
    import core.train as T

    seen = {}
    monkeypatch.setattr(T.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(T.dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    monkeypatch.delenv("RANK", raising=False)
    cfg = registry.get(PP8_ROWS[1]).job_config("real")
    T.init_distributed(cfg)
    assert seen["timeout"].total_seconds() == first_step_timeout(cfg).seconds == 1260


# ------------------------------------------------------------------ multi-process (slow)
# Short, so that a fast CPU's cold compile of the two stages outlasts it too (9.1 s measured on 2
# busy AVX-512 cores with inductor's precompiled header built: 10 s failed there). Nothing before
# the first step waits on it alone: the groups are made with the first step's whole timeout.
SHORT_INIT_TIMEOUT_S = 3


@pytest.mark.slow
@pytest.mark.realpath
def test_a_cold_compiled_pipeline_outlasts_a_short_init_timeout(tmp_path):
    """pp 2 compiled on an empty inductor cache with a short comm.init_timeout_seconds: each rank
    waits in a recv while the other compiles, longer than that (before the first step's timeout,
    gloo's recv timed out: "Timed out waiting 10000ms"). Its groups now allow it + 2 x 120 s."""
    overrides = [*TINY_JOB, "--model.flavor=tiny4", "--parallelism.pp=2", "--parallelism.pp_microbatches=4"]
    overrides += ["--training.steps=2", "--compile.enabled=true", "--compile.shared_cache=off"]
    overrides += [f"--comm.init_timeout_seconds={SHORT_INIT_TIMEOUT_S}"]
    rec = run_trainer(2, overrides, tmp_path / "run", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")})
    assert rec["first_step_timeout_s"] == SHORT_INIT_TIMEOUT_S + 2 * COLD_STAGE_COMPILE_S
    assert "pp 2 x 120 s" in rec["first_step_timeout_reason"]
    assert rec["timings_s"]["first_step"] > SHORT_INIT_TIMEOUT_S  # it outlasted comm.init_timeout_seconds
    assert rec["fxgraph_cache_all_ranks"]["miss"] > 0  # and it compiled cold


PP_LAYOUTS = [layout for layout in PL.LAYOUTS if layout.pp > 1]
# bf16: autocast (fp32 between stages) and FSDP2's policy (bf16 between stages, DTensor logits)
CASES = [(layout.name, "fp32") for layout in PP_LAYOUTS] + [("pp2_1f1b", "bf16"), ("fsdp2_tp2_pp2", "bf16")]


def _job(name: str, dtype: str) -> str:
    return f"ppstatic.{name}.{dtype}"


# Static shapes here; the same layout with torch's inference is the parity suite's run (parity_runs).
# Static shapes change only how the stages are built, before the first step; the same program runs
# from there on, so the claim is the first STATIC_STEPS steps bit for bit: they span the warmup and
# the first update at the full LR, none of which depends on training.steps (core.optim.lr_factor).
STATIC_STEPS = 4
for _name, _dtype in CASES:
    _layout = PL.BY_NAME[_name]
    _static = [*_layout.overrides(_dtype), STATIC, f"--training.steps={STATIC_STEPS}"]
    GROUPS.add(_layout.world_size, {_job(_name, _dtype): _static})


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_static_shapes_give_the_dynamic_losses(name, dtype, parity_runs, tmp_path_factory):
    """Every PP layout of the parity suite (every schedule at pp 2 and 4, FSDP x TP x PP (x CP)):
    the same per-step losses and grad norms, bit for bit, as the parity run of the layout (torch's
    dynamic inference, the default), over its first STATIC_STEPS steps."""
    static, dynamic = GROUPS.get(_job(name, dtype), tmp_path_factory), parity_runs.get(name, dtype)
    k = STATIC_STEPS
    assert len(static["losses"]) == k < len(dynamic["losses"]) == PL.STEPS
    assert static["losses"] == dynamic["losses"][:k] and static["grad_norms"] == dynamic["grad_norms"][:k]
    assert "pp_static_shapes" in static["toggles_applied"]
    assert "pp_static_shapes" not in dynamic["toggles"]
    layout = PL.BY_NAME[name]
    assert max_abs_diff(static["losses"], dynamic["reference"][:k]) <= (layout.tolerance or PL.TOLERANCE[dtype])
    assert static["first_step_timeout_s"] == 300 and static["first_step_timeout_reason"] == "comm.init_timeout_seconds"


# One torchrun per world size: (name, world, overrides) of the layouts whose inferred metadata is compared.
_TINY_PP = [*TINY_JOB, "--model.flavor=tiny4", "--parallelism.pp=2", "--parallelism.pp_microbatches=4"]
_BF16 = "--training.mixed_precision_param=bfloat16"
SHAPE_JOBS = {
    2: {
        "pp2_fp32_1f1b": [*_TINY_PP],
        "pp2_autocast_interleaved": [*_TINY_PP, _BF16, "--parallelism.pp_schedule=Interleaved1F1B"],
        "pp2_compiled": [*_TINY_PP, "--compile.enabled=true"],
    },
    4: {
        "fsdp2_pp2_bf16_zbv": [*_TINY_PP, _BF16, "--parallelism.dp_shard=2", "--training.local_batch_size=4"]
        + ["--parallelism.pp_schedule=ZBVZeroBubble"],
        "tp2_pp2_loss_parallel": [*_TINY_PP, _BF16, "--parallelism.tp=2"],
        "tp2_pp2_whole_logits": [*_TINY_PP, "--parallelism.tp=2", "--parallelism.loss_parallel=false"],
        "cp2_pp2_bf16": [*_TINY_PP, _BF16, "--parallelism.cp=2"],
    },
    8: {"cp2_tp2_pp2_bf16": [*_TINY_PP, _BF16, "--parallelism.cp=2", "--parallelism.tp=2"]},
}


def _shape_reports(world: int, jobs: dict[str, list[str]], root: Path) -> dict[str, list[dict]]:
    root.mkdir(parents=True, exist_ok=True)
    plan = {"root": str(root), "jobs": [{"name": n, "overrides": o} for n, o in jobs.items()]}
    (root / "plan.json").write_text(json.dumps(plan))
    cmd = torchrun_command(world, ["-m", "tests.pp_shapes_driver", str(root / "plan.json")], forked=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=dist_env(world), capture_output=True, text=True, timeout=1800)
    (root / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    return {n: [json.loads((root / n / f"rank_{r}.json").read_text()) for r in range(world)] for n in jobs}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SHAPE_JOBS))
def test_example_shapes_equal_what_dynamic_inference_records(world, tmp_path):
    """Each stage's inferred inputs, outputs and their gradients (shape, stride, dtype,
    requires_grad; the DTensor layout of loss-parallel logits) equal the examples; the static
    stages then pass torch's own per-microbatch checks (DETAIL) with the same first loss."""
    for name, ranks in _shape_reports(world, SHAPE_JOBS[world], tmp_path).items():
        stages = {sid: diffs for rank in ranks for sid, diffs in rank["stages"].items()}
        looped = "interleaved" in name or "zbv" in name  # 2 stages per rank
        assert sorted(stages) == [str(s) for s in range(4 if looped else 2)], (name, stages)
        assert all(diffs == [] for diffs in stages.values()), (name, stages)
        assert all(r["static_loss"] == r["dynamic_loss"] for r in ranks), (name, ranks)
