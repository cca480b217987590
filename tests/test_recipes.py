"""Recipe rows as data: discovery, validation in both modes, proxy fidelity, reference figures."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from core.validate import validate
from recipes import registry
from recipes.schema import TABLES, RecipeError, deep_merge

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[1]
IDS = [r.id for r in registry.all_recipes()]
DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


def _cfgs(rid):
    r = registry.get(rid)
    paper = validate(r.job_config("real"), check_files=False)
    proxy = validate(r.job_config("proxy"), check_files=False)
    return r, paper, proxy


def test_registry_finds_the_22_rows_with_ids_matching_paths():
    assert len(IDS) == 22 and len(set(IDS)) == 22
    for r in registry.all_recipes():
        assert r.source == f"{r.id}.toml"
        assert (ROOT / r.source).is_file()
    counts = {t: len(registry.by_table(t)) for t in TABLES}
    assert counts == {"table1": 6, "table2": 2, "table3": 2, "table4": 4, "table5": 4, "loss_convergence": 4}
    assert [r.order for r in registry.by_table("table1")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("rid", IDS)
def test_row_validates_in_paper_and_proxy_form(rid):
    r, paper, proxy = _cfgs(rid)
    assert paper.parallelism.world_size == r.gpus
    four_d = all(getattr(proxy.parallelism, d) > 1 for d in ("dp_shard", "cp", "tp", "pp"))
    assert proxy.parallelism.world_size <= (16 if four_d else 8)
    assert paper.model.flavor in ("8B", "70B", "405B")
    assert proxy.model.flavor in ("debug", "tiny", "tiny4", "small")
    # the paper's data, C4: streamed from the hub on one node, a local copy of it across nodes
    # (never the offline stand-in corpus of the proxies)
    if r.nnodes() > 1:
        assert paper.data.dataset == "c4_offline" and paper.data.path.endswith("data/c4")
    else:
        assert paper.data.dataset == "c4" or r.table == "loss_convergence"
    assert paper.tokenizer.path.endswith("llama3/tokenizer.model")
    assert proxy.data.dataset == "c4_offline"
    assert proxy.tokenizer.path.endswith("proxy_bpe_4k/tokenizer.model")
    assert paper.training.mixed_precision_param == "bfloat16"
    assert paper.job.recipe == proxy.job.recipe == rid
    assert (paper.job.mode, proxy.job.mode) == ("real", "proxy")


def _toggles(cfg):
    p = cfg.parallelism
    return {
        "dims": {d for d in DIMS if getattr(p, d) > 1},
        "schedule": p.pp_schedule if p.pp > 1 else None,
        "async_tp": p.enable_async_tp,
        "compile": cfg.compile.enabled,
        "float8": (
            cfg.float8.enabled,
            cfg.float8.recipe,
            cfg.float8.enable_fsdp_float8_all_gather,
            cfg.float8.precompute_float8_dynamic_scale_for_fsdp,
        ),
        "ac": (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option),
        "reduce": cfg.training.mixed_precision_reduce,
    }


@pytest.mark.parametrize("rid", IDS)
def test_proxy_keeps_dims_schedule_and_toggles(rid):
    r, paper, proxy = _cfgs(rid)
    assert _toggles(proxy) == _toggles(paper)
    # the techniques list says the same as the config
    t = _toggles(paper)
    expect = set()
    expect |= {"fsdp"} if paper.parallelism.dp_shard > 1 else set()
    expect |= {"tp"} if "tp" in t["dims"] else set()
    expect |= {"cp"} if "cp" in t["dims"] else set()
    expect |= {f"pp:{t['schedule']}"} if t["schedule"] else set()
    expect |= {"async_tp"} if t["async_tp"] else set()
    expect |= {"compile"} if t["compile"] else set()
    expect |= {"float8"} if t["float8"][0] else set()
    assert set(r.techniques) == expect


@pytest.mark.parametrize("rid", IDS)
def test_float8_emulated_only_where_intended(rid):
    """Real and dry-run use the float8 GEMM; CPU proxies emulate it (CPU _scaled_mm takes
    seconds per matmul), except the loss-convergence rows, whose curves check the real kernel."""
    r, paper, proxy = _cfgs(rid)
    assert not paper.float8.emulate
    if proxy.float8.enabled:
        assert proxy.float8.emulate == (r.table != "loss_convergence")


@pytest.mark.parametrize("rid", IDS)
def test_requirements_follow_the_config(rid):
    r, paper, _ = _cfgs(rid)
    real = r.requires["real"]
    assert f"cuda>={r.gpus}" in real
    assert ("sm89" in real) == paper.float8.enabled
    assert set(r.requires.get("advisory", ())) == ({"sm90", "nvswitch"} if paper.parallelism.enable_async_tp else set())
    assert r.requires["proxy"] == ("cpu",)


# figures transcribed from the paper (arXiv 2410.06511) and torchtitan's public benchmark file
REFERENCE = {
    "llama3_8b/table1/8gpu_fsdp": {
        "paper_tps_per_gpu": 6258,
        "paper_mem_gib": 81.9,
        "paper_mem_approx": True,
        "bench_tps_per_gpu": 5762,
        "bench_mem_gib": 82.4,
    },
    "llama3_8b/table1/128gpu_fsdp_compile_float8": {
        "paper_tps_per_gpu": 9319,
        "paper_mem_gib": 61.8,
        "paper_mem_approx": True,
        "bench_tps_per_gpu": 8380,
        "bench_mem_gib": 61.8,
    },
    "llama3_70b/table2/256gpu_fsdp_tp_compile_float8_asynctp": {
        "paper_tps_per_gpu": 1010,
        "paper_mem_gib": 67.7,
        "bench_tps_per_gpu": 876,
        "bench_mem_gib": 67.6,
    },
    "llama3_405b/table3/512gpu_3d_interleaved_1f1b": {
        "paper_tps_per_gpu": 130,
        "paper_mem_gib": 80.3,
        "bench_tps_per_gpu": 128,
        "bench_mem_gib": 72.7,
    },
    "long_context/table4/8b_fsdp1_cp8_256k": {"paper_tps_per_gpu": 548, "paper_mem_gib": 84.5},
    "long_context/table5/405b_fsdp8_cp1_32k": {"paper_tps_per_gpu": 76, "paper_mem_gib": 75.3},
    "llama3_8b/loss_convergence/1d_fsdp8": {},
}


@pytest.mark.parametrize("rid", sorted(REFERENCE))
def test_reference_figures_equal_the_paper_tables(rid):
    assert registry.get(rid).reference == REFERENCE[rid]


@pytest.mark.parametrize(
    "rid, gain",
    [
        ("llama3_8b/table1/8gpu_fsdp_compile", 6.6),
        ("llama3_8b/table1/8gpu_fsdp_compile_float8", 50.3),
        ("llama3_8b/table1/128gpu_fsdp_compile", 14.8),
        ("llama3_8b/table1/128gpu_fsdp_compile_float8", 65.08),
        ("llama3_70b/table2/256gpu_fsdp_tp_compile_float8_asynctp", 12.59),
        ("llama3_405b/table3/512gpu_3d_interleaved_1f1b", 30.0),
    ],
)
def test_paper_gains_follow_from_the_baselines(rid, gain):
    r = registry.get(rid)
    base = registry.get(r.baseline)
    got = 100 * (r.reference["paper_tps_per_gpu"] / base.reference["paper_tps_per_gpu"] - 1)
    assert abs(got - gain) < 0.1


def test_paper_configurations_of_each_table():
    for r in registry.by_table("table1"):
        c = validate(r.job_config("real"), check_files=False)
        assert (c.model.flavor, c.training.local_batch_size, c.training.seq_len) == ("8B", 2, 8192)
        assert (c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option) == ("selective", "op")
        assert c.parallelism.dp_shard == r.gpus
    for r in registry.by_table("table2"):
        c = validate(r.job_config("real"), check_files=False)
        assert (c.model.flavor, c.parallelism.dp_shard, c.parallelism.tp) == ("70B", 32, 8)
        assert c.training.local_batch_size * c.parallelism.dp_shard == 512
        assert c.activation_checkpoint.mode == "full" and c.compile.enabled and c.float8.enabled
    schedules = []
    for r in registry.by_table("table3"):
        c = validate(r.job_config("real"), check_files=False)
        p = c.parallelism
        assert (c.model.flavor, p.dp_shard, p.tp, p.pp) == ("405B", 8, 8, 8)
        assert c.training.local_batch_size * p.dp_shard == 256 and p.enable_async_tp
        schedules.append(p.pp_schedule)
        px = validate(r.job_config("proxy"), check_files=False)
        assert (px.model.flavor, px.parallelism.world_size) == ("tiny4", 8)
    assert schedules == ["1F1B", "Interleaved1F1B"]
    seqs = [32768, 65536, 131072, 262144]
    for table, flavor in (("table4", "8B"), ("table5", "405B")):
        rows = registry.by_table(table)
        got = [validate(r.job_config("real"), check_files=False) for r in rows]
        assert [c.training.seq_len for c in got] == seqs
        assert [(c.parallelism.dp_shard, c.parallelism.cp) for c in got] == [(8, 1), (4, 2), (2, 4), (1, 8)]
        assert {c.model.flavor for c in got} == {flavor}
        proxies = [validate(r.job_config("proxy"), check_files=False) for r in rows]
        assert [c.training.seq_len for c in proxies] == [s // 64 for s in seqs]
    for r in registry.by_table("loss_convergence"):
        c = validate(r.job_config("real"), check_files=False)
        assert (c.training.local_batch_size, c.training.steps, c.lr_scheduler.warmup_steps) == (4, 3000, 600)
        assert c.parallelism.dp_shard == 8
        px = validate(r.job_config("proxy"), check_files=False)
        assert (px.parallelism.dp_shard, px.training.local_batch_size) == (2, 4)  # fixed across layouts


def test_get_suggests_close_ids_and_select_patterns():
    with pytest.raises(RecipeError, match="did you mean: llama3_8b/table1/8gpu_fsdp"):
        registry.get("llama3_8b/table1/8gpu_fsd")
    assert registry.get("llama3_8b/table1/8gpu_fsdp.toml").id == "llama3_8b/table1/8gpu_fsdp"
    assert len(registry.select(["long_context/*"])) == 8
    both = registry.select(["llama3_8b/table1/8gpu_fsdp"], "table1")
    assert len(both) == 6 and both[0].id == "llama3_8b/table1/8gpu_fsdp"
    with pytest.raises(RecipeError):
        registry.select(["nothing/*"])


def test_deep_merge_tables_merge_values_replace():
    base = {"a": {"x": 1, "y": [1, 2]}, "b": 1}
    out = deep_merge(base, {"a": {"y": [3]}, "c": 2})
    assert out == {"a": {"x": 1, "y": [3]}, "b": 1, "c": 2}
    assert base == {"a": {"x": 1, "y": [1, 2]}, "b": 1}


def _recipes_imports() -> dict[str, set[str]]:
    """recipes.* module -> the recipes.* modules it imports (anywhere in the file)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "recipes").rglob("*.py")
    }
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in files and m != name and m != "recipes"}
    return graph


def test_recipes_imports_run_one_way():
    """No import cycle in recipes/; the run path never imports a study (the CLI finds them by name)."""
    graph = _recipes_imports()
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle
    upward = [
        (m, d)
        for m, deps in graph.items()
        if not m.startswith("recipes.studies")
        for d in deps
        if d.startswith("recipes.studies")
    ]
    assert not upward, upward
