"""What real mode (CUDA, clusters) does differently from the CPU proxies, run on a CPU:
per-stage seeds on the meta-device init, memory peaks, data time in the step, per-rank data
sharding, the sbatch script and launch environment, mesh timeouts, the torchao pin, Flight
Recorder file names on CUDA, and `run-recipe preflight`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import tomllib
import torch

from core import debug, metrics
from core.config import ConfigError, load_config
from core.data.datasets import TokenWindowLoader, data_sharding, synthetic_document
from core.parallel.mesh import ParallelDims, mesh_groups
from core.train import Trainer
from core.validate import validate
from recipes import cluster_env, launcher, modes, multinode, paths, registry
from recipes.studies import preflight as P
from tests.dist_utils import TINY_JOB

pytestmark = pytest.mark.realpath
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- defect 1: init
@pytest.mark.slow
def test_meta_init_seeds_each_pipeline_stage(tmp_path):
    """PP 4 on the meta path: torch's default (one seed for all) repeats the blocks of stages
    1-3, which the check sees; per-stage seeds make every stage's blocks its own."""
    job = [
        "--model.flavor=tiny4",
        "--data.dataset=synthetic",
        "--training.seq_len=64",
        "--training.local_batch_size=4",
        "--parallelism.pp=4",
        "--parallelism.pp_schedule=1F1B",
        *P.META,
    ]
    fixed = P.check_init(P.run_init_check(4, job, tmp_path / "fixed.json"))
    assert fixed == []
    same = P.check_init(P.run_init_check(4, job, tmp_path / "same.json", same_seed=True))
    repeats = [p for p in same if "repeats block 0 of stage 1" in p]
    assert {p.split(":")[0] for p in repeats} == {"stage 2", "stage 3"}, same


def test_check_init_catches_disagreeing_ranks_and_copied_shards():
    ranks = [
        {"rank": r, "pp_rank": 0, "stages": {"0": {"layers.0.attention.wq.weight": (f"w{r}", f"l{0}")}}}
        for r in range(2)
    ]
    problems = P.check_init({"ranks": ranks})
    assert any("ranks disagree" in p for p in problems) and any("every shard" in p for p in problems)


def test_mesh_subgroups_get_the_configured_timeout(pg):
    mesh = ParallelDims(1, 1, 1, 1, 1, 1).build_mesh("cpu", timeout_seconds=123)
    groups = mesh_groups(mesh)
    assert len(groups) >= 1
    assert all(debug.pg_timeout_seconds(g) == 123 for g in groups)


def test_mesh_hands_out_one_object_per_view(pg):
    """Every pipeline stage gets the same tp (and dp) mesh object: compiled blocks guard on it,
    and a second object made each stage compile its blocks again."""
    mesh = ParallelDims(1, 1, 1, 1, 1, 1).build_mesh("cpu")
    assert mesh["tp"] is mesh["tp"] and mesh["dp_shard_cp"] is mesh["dp_shard_cp"]
    assert mesh.root["tp"] is not mesh.root["tp"]  # torch's own slicing: a new object each time


def test_init_device_and_sharding_are_checked_choices():
    for key, bad in (("model.init_device", "gpu"), ("data.sharding", "everywhere")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(load_config(None, [f"--{key}={bad}"]), 1, check_files=False)
    cfg = load_config(None, ["--job.mode=real"])
    assert data_sharding(cfg) == "per_rank"
    assert data_sharding(load_config(None, [])) == "global"  # proxies and parity keep the global slices
    assert data_sharding(load_config(None, ["--job.mode=real", "--data.sharding=global"])) == "global"


# ----------------------------------------------------------------------- defect 2: memory
def test_peak_memory_is_reset_after_the_first_step(monkeypatch):
    fake = {"peak": 10 * 2**30, "now": 4 * 2**30}
    monkeypatch.setattr(metrics.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(metrics.torch.cuda, "max_memory_reserved", lambda: fake["peak"])
    monkeypatch.setattr(metrics.torch.cuda, "reset_peak_memory_stats", lambda: fake.update(peak=fake["now"]))
    for name in ("synchronize", "empty_cache"):  # the cache is released before the reset
        monkeypatch.setattr(metrics.torch.cuda, name, lambda: None)
    mem = metrics.PeakMemory()
    assert mem.first_step_done() == 10.0 and mem.first_step == 10.0
    assert mem.steady() == 4.0


def test_launch_env_sets_expandable_segments_for_real_runs(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert modes.RealMode().env(8)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in modes.PROXY.env(2)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # the user's own wins
    assert modes.RealMode().env(8)["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


# ------------------------------------------------------------------- defect 3: data, timing
def test_step_time_includes_the_data_and_records_it_apart(pg, tmp_path, monkeypatch):
    cfg = validate(
        load_config(None, [*TINY_JOB, "--training.steps=3", f"--job.output_dir={tmp_path}"]), 1, check_files=False
    )
    trainer = Trainer(cfg)
    loader = trainer.dataloader

    class Slow:
        def __iter__(self):
            return self

        def __next__(self):
            time.sleep(0.3)
            return next(loader)

        def __getattr__(self, name):  # the loader's other state (bad_documents) as it is
            return getattr(loader, name)

    trainer.dataloader = Slow()
    rec = trainer.train()
    assert len(rec["data_times_s"]) == 3 and min(rec["data_times_s"]) >= 0.3
    assert all(s >= d for s, d in zip(rec["step_times_s"], rec["data_times_s"], strict=True))
    assert min(rec["step_times_s"]) >= 0.3 and rec["data_time_s"] >= 0.3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(x["data_time_s"] >= 0.3 for x in lines)
    assert "first_step_peak_memory_gib" in rec and len(rec["first_step_peak_memory_gib_per_rank"]) == 1


class Counting:
    """A tokenizer wrapper that remembers which documents it was given."""

    def __init__(self, inner):
        self.inner, self.texts = inner, []
        self.n_words = inner.n_words

    def encode(self, text, bos, eos):
        self.texts.append(text)
        return self.inner.encode(text, bos=bos, eos=eos)


def _synthetic(rank, degree, sharding, tok=None):
    from core.data.tokenizer import ByteTokenizer

    return TokenWindowLoader(
        "synthetic",
        tokenizer=tok or Counting(ByteTokenizer()),
        seq_len=32,
        local_batch_size=2,
        dp_rank=rank,
        dp_degree=degree,
        sharding=sharding,
    )


def test_per_rank_sharding_reads_only_its_own_documents_and_resumes_exactly():
    loaders = [_synthetic(r, 4, "per_rank") for r in range(4)]
    for loader in loaders:
        for _ in range(20):
            next(loader)
    read = [set(ld.tokenizer.texts) for ld in loaders]
    for r, texts in enumerate(read):
        n = len(loaders[r].tokenizer.texts)
        assert texts == {synthetic_document(r + 4 * i) for i in range(n)}
    assert not set.intersection(*read)
    # the global layout tokenizes everything on every rank
    glob = _synthetic(1, 4, "global")
    for _ in range(20):
        next(glob)
    assert len(glob.tokenizer.texts) >= 3 * len(loaders[1].tokenizer.texts) > 0
    # resume: the same rank continues on the exact next token; another rank or degree is refused
    state = loaders[2].state_dict()
    want = [next(loaders[2]) for _ in range(3)]
    again = _synthetic(2, 4, "per_rank")
    again.load_state_dict(json.loads(json.dumps(state)))
    got = [next(again) for _ in range(3)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got, strict=True))
    for other in (_synthetic(1, 4, "per_rank"), _synthetic(2, 8, "per_rank"), _synthetic(2, 4, "global")):
        with pytest.raises(ValueError, match="sharding"):
            other.load_state_dict(state)


def test_per_rank_sharding_splits_a_c4_layout_corpus_by_files():
    path, tok = ROOT / "assets" / "c4_offline", ROOT / "assets" / "tokenizer" / "proxy_bpe_4k" / "tokenizer.model"
    if not path.exists() or not tok.exists():
        pytest.fail("assets missing: python -m core.data.assets --all")
    kw = {
        "path": str(path),
        "tokenizer": str(tok),
        "seq_len": 32,
        "local_batch_size": 2,
        "dp_degree": 2,
        "sharding": "per_rank",
    }
    a, b = TokenWindowLoader("c4_offline", dp_rank=0, **kw), TokenWindowLoader("c4_offline", dp_rank=1, **kw)
    assert not torch.equal(next(a)[0], next(b)[0])
    state = b.state_dict()
    want = [next(b)[0] for _ in range(2)]
    c = TokenWindowLoader("c4_offline", dp_rank=1, **kw)
    c.load_state_dict(state)
    assert all(torch.equal(w, next(c)[0]) for w in want)


# ------------------------------------------------------------------------ defect 4: cluster
def _sbatch(tmp_path) -> str:
    recipe = registry.get("llama3_8b/table1/128gpu_fsdp")
    cfg = registry.resolve_config(recipe, "real")
    return multinode.sbatch_script(recipe, cfg, tmp_path, nnodes=16, nproc=8, records_dir=None)


def test_sbatch_binds_cpus_and_keeps_caches_node_local(tmp_path):
    script = _sbatch(tmp_path)
    srun = next(line for line in script.splitlines() if line.startswith("srun"))
    assert '--cpus-per-task="$cpus_per_node"' in srun and "--cpu-bind=none" in srun
    assert "$numa_flag" in script and "--numa-binding=" in script
    assert "export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" in script
    assert str(paths.project_root() / ".cache") not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    # the environment block as the node's shell evaluates it
    block = (
        "\n".join(cluster_env.sbatch_env_lines(8))
        + '\necho "$OMP_NUM_THREADS|$PYTORCH_CUDA_ALLOC_CONF|$TORCHINDUCTOR_CACHE_DIR|$numa_flag"'
    )
    env = {"PATH": os.environ["PATH"], "SLURM_CPUS_ON_NODE": "96", "TMPDIR": "/local", "USER": "u"}
    out = subprocess.run(["bash", "-euc", block], env=env, capture_output=True, text=True, check=True).stdout
    omp, alloc, cache, _ = out.strip().split("|")
    assert (omp, alloc, cache) == ("12", "expandable_segments:True", "/local/titan_inductor_u")
    env.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False", OMP_NUM_THREADS="3", TITAN_NUMA_BINDING="")
    out = subprocess.run(["bash", "-euc", block], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().split("|") == ["3", "expandable_segments:False", "/local/titan_inductor_u", ""]


def test_torchao_is_pinned_to_the_tested_version():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torchao")]
    assert pin == f"torchao=={importlib.metadata.version('torchao')}"


def test_flight_recorder_on_cuda_dumps_nccl_recorder_to_our_own_file(pg, tmp_path, monkeypatch):
    cfg = validate(
        load_config(None, [f"--job.output_dir={tmp_path}", "--comm.trace_buf_size=10"]), 1, check_files=False
    )
    called = []
    raw = torch._C._distributed_c10d._dump_fr_trace()

    def nccl_trace():
        called.append(True)
        return raw

    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", nccl_trace, raising=False)
    monkeypatch.setattr(debug.torch.cuda, "is_available", lambda: True)
    path = debug.dump_flight_recorder(cfg, reason="test")
    assert called and path.name == "titan_rank_0" and not (path.parent / "rank_0").exists()
    assert debug.read_traces(path.parent)[0]["titan_reason"] == "test"
    monkeypatch.undo()
    assert debug.dump_flight_recorder(cfg, reason="gloo").name == "rank_0"  # gloo: no watchdog to collide with


# ---------------------------------------------------------------------------------- preflight
@pytest.mark.slow
def test_preflight_proxy_form_passes_and_names_what_it_skipped(tmp_path):
    cmd = [launcher.sys.executable, "-m", "recipes.cli", "preflight", "--out", str(tmp_path)]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=modes.PROXY.env(1), capture_output=True, text=True, timeout=900, check=False
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "preflight.json").read_text())
    status = {v["feature"]: v["status"] for v in summary["verdicts"]}
    assert summary["passed"] and "FAIL" not in status.values()
    for feature in (
        "meta-device init (FSDP 2 x TP 2 x PP 2, per-stage seeds)",
        "FSDP x TP x PP, Interleaved 1F1B",
        "context parallel (CP 2 x TP 2)",
        "compile (per block)",
        "Float8 linears",
        "DCP save + load (resume)",
    ):
        assert status[feature] == "PASS", (feature, status)
    assert any(f.startswith("loss parity 3D") and s == "PASS" for f, s in status.items())
    assert {status["NCCL"], status["AsyncTP"], status["Float8 matmuls (sm89+)"]} == {"SKIP"}
    assert "tokens/s/device" in proc.stdout and "peak memory" in proc.stdout
    print(f"preflight wall {wall:.0f} s (goal: under 180 s on 2 free cores)")


def test_a_failing_compile_warm_up_leaves_the_failure_to_the_ranks(monkeypatch):
    """The warm-up before the fork is only a head start: when it fails (say, no C++ compiler) the
    launch goes on, and each rank's own compile meets the failure and reports it as a rank's."""
    import core.toggles.compile as compile_mod
    from core.config import load_config
    from core.lazy_imports import prepare_for_fork

    calls = []
    monkeypatch.setattr(compile_mod, "warm_before_fork", lambda: calls.append(1) or 1 / 0)
    prepare_for_fork([load_config(None, ["compile.enabled=true"])])
    prepare_for_fork([load_config(None, [])])  # eager jobs: no warm-up
    assert calls == [1]


# ----------------------------------------------------------------------------- forked launch
RANK_CATCHING_ALL = """
import signal, sys, time
if __name__ == "__main__":
    names = {signal.SIG_DFL: "default", signal.default_int_handler: "KeyboardInterrupt"}
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    print("rank handlers:", *(names.get(signal.getsignal(s), "other") for s in sigs), flush=True)
    for _ in range(2):  # what DCP does with an exception raised in a save: carry on
        try:
            time.sleep(60)
        except Exception:
            print("rank: caught an exception, carrying on", flush=True)
"""


@pytest.mark.slow
def test_a_forked_rank_dies_on_the_agents_sigterm_as_a_torchrun_rank_does(tmp_path):
    """A forked rank has the signal handlers of a new interpreter, not the agent's (torch elastic
    raises a SignalException on SIGTERM there): the agent's SIGTERM ends a rank that catches every
    exception at once, not after the agent's 30 s wait and SIGKILL."""
    (tmp_path / "rank_catching_all.py").write_text(RANK_CATCHING_ALL)
    env = {**launcher.base_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    cmd = launcher.torchrun_command(1, ["-m", "rank_catching_all"], forked=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = ""
        while not said.startswith("rank handlers:") and proc.poll() is None:  # the rank's first line
            said = proc.stdout.readline()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        proc.kill()
    assert said.split()[2:] == ["default", "KeyboardInterrupt", "default", "default"], said
    assert "caught an exception" not in rest and stopped_s < 15, (stopped_s, rest[-2000:])


RANK_REPORTING_GC = """
import gc
if __name__ == "__main__":
    print("rank gc:", gc.isenabled(), gc.get_freeze_count(), flush=True)
"""


def test_a_forked_rank_collects_garbage_but_not_what_its_launcher_imported(tmp_path):
    """The launcher imports torch and the trainer with the collector off, then freezes what it made
    before forking (Python's recipe for forks): a rank's full collections skip those objects, and
    so do not walk, or copy, the pages they share with the launcher. The rank itself collects."""
    (tmp_path / "rank_reporting_gc.py").write_text(RANK_REPORTING_GC)
    env = {**launcher.base_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    cmd = launcher.torchrun_command(1, ["-m", "rank_reporting_gc"], forked=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = next(line for line in proc.stdout.splitlines() if line.startswith("rank gc:"))
    enabled, frozen = said.split()[2:]
    assert enabled == "True" and int(frozen) > 100_000, said  # torch alone is several 100,000 objects


RANK_REPORTING_STORE = """
import os
if __name__ == "__main__":
    print("rank store:", os.environ["TORCHELASTIC_USE_AGENT_STORE"], flush=True)
"""


def test_a_forked_launch_gives_its_ranks_rank_0s_store_never_the_agents(tmp_path):
    """The agent's shared store is served by a thread of the process that forks the ranks, busy with
    the first ranks while it forks the next; a rank forked meanwhile could hang in its store client.
    A forked launch turns the sharing off, even where the caller's environment turns it on."""
    (tmp_path / "rank_reporting_store.py").write_text(RANK_REPORTING_STORE)
    env = {**launcher.base_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", cluster_env.UNSHARED_STORE_ENV: "0"}
    cmd = launcher.torchrun_command(2, ["-m", "rank_reporting_store"], forked=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("rank store:")]
    assert said == ["rank store: False"] * 2, proc.stdout[-2000:]


def test_what_a_forked_launch_imports_first_starts_no_thread():
    """recipes/forked_run.py forks the ranks after core.train.before_fork imported what the jobs
    import lazily. Forking is only safe while the process has one thread: importing those modules
    must not start any (HF `datasets` would start pyarrow's jemalloc purging thread, which
    core.lazy_imports turns off first). For a compiled job it also warms what each rank's first
    compile would compute alike: the ISA probes (their threads joined) and the precompiled header."""
    script = (
        "import os, sys\n"
        "import core.train\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = threads()\n"
        "core.train.before_fork(['--compile.enabled=true', '--float8.enabled=true', '--data.dataset=c4_offline'])\n"
        "mods = ('torch._inductor.compile_fx', 'torchao.float8', 'datasets')\n"
        "from torch._inductor import codecache, cpu_vec_isa\n"
        "warmed = (cpu_vec_isa.valid_vec_isa_list, codecache._precompile_header)\n"
        "print(before, threads(), *(m in sys.modules for m in mods), *(f.cache_info().currsize for f in warmed))\n"
    )
    proc = subprocess.run(
        [launcher.sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after, compile_fx, float8, datasets, isas, headers = proc.stdout.split()[-7:]
    assert after == before and (compile_fx, float8, datasets) == ("True", "True", "True"), proc.stdout
    assert (isas, headers) == ("1", "1"), proc.stdout  # inherited by every rank: not probed again
