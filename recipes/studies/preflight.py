"""`run-recipe preflight`: the first command on a new node, before paying for many.

A few minutes of a small model through every feature the paper's rows need, each launched with
`recipes.launcher.torchrun_command`, and a plain verdict per feature:
- single process: the seed checkpoint (the initial weights, step 0), then the reference run from it.
- meta init: FSDP x TP x PP built on the meta device, each rank initialising its own shards;
  checked by a worker (`--worker init`): no two pipeline stages hold identical blocks, every
  rank of a stage sees the same whole tensors, shards of one tensor are not copies.
- 3D parity: FSDP 2 x TP 2 x PP 2 with Interleaved 1F1B on the meta path, loaded from the seed
  checkpoint, against the single-process losses.
- CP + compile + Float8 (its TP styles) + DCP: CP 2 x TP 2, compiled, Float8 (emulated where
  the hardware has no float8 matmuls), saving DCP checkpoints; then a resumed run that loads the
  last one and must continue.
Memory and throughput of each run are printed. What cannot run here is listed as skipped with
its reason (CPU: NCCL, AsyncTP, real Float8 matmuls). Exit 0 when every feature that can run passed.

`run-recipe preflight --gpus 1` is the one-device form instead (recipes/studies/preflight_one.py):
the device measured into a spec, a one-device step predicted on it, run, and compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
from click.core import ParameterSource

from core.fileio import atomic_write_json
from recipes import launcher, modes, paths
from recipes.options import check_writable, out_dir_option, refuse
from recipes.studies.parity_layouts import base_job
from recipes.studies.preflight_one import one_device_options

STEPS = 6
PARITY_TOL = 1e-5  # fp32 on CPU gloo: only the summation order differs (as recipes/studies/parity.py)
# The real form compares eager 3D on GPUs (NCCL's ring/tree reduction order) with a compiled
# single GPU (inductor fuses pointwise ops and reassociates fp32 sums): a bound, not a fit: an fp32
# sum of K = 4096 terms in another order moves by up to about K x 2^-23 = 4.9e-4 relative.
PARITY_TOL_REAL = 5e-4  # relative to the loss
BASE = [  # the parity suite's tiny job (seq 64), on the 4-layer flavor, in fp32
    "--model.flavor=tiny4",
    *base_job(STEPS),
    "--training.local_batch_size=8",
    "--training.mixed_precision_param=float32",
    "--training.mixed_precision_reduce=float32",
]
LAYOUT_3D = [
    "--parallelism.dp_shard=2",
    "--parallelism.tp=2",
    "--parallelism.pp=2",
    "--parallelism.pp_schedule=Interleaved1F1B",
    "--training.local_batch_size=4",
]
META = ["--model.init_device=meta"]


# ------------------------------------------------------------------------------ init worker
def _digest(t) -> str:
    return hashlib.sha256(t.detach().contiguous().float().cpu().numpy().tobytes()).hexdigest()[:16]


def init_report(overrides: list[str], per_stage: bool = True) -> dict | None:
    """Under torchrun: build the model on the meta path and describe what each rank holds.
    Rank 0 returns {"ranks": [{rank, pp_rank, stages: {stage: {param: (whole, local)}}}]}."""
    import torch  # local: `run-recipe --help` must not import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from core.build import build_model
    from core.config import load_config
    from core.models.args import model_args
    from core.parallel.mesh import ParallelDims
    from core.parallel.parallelize import Toggles
    from core.step import pipeline_loss
    from core.train import init_distributed
    from core.validate import validate

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = validate(load_config(None, overrides), world, check_files=False)
    init_distributed(cfg)
    dims = ParallelDims.from_config(cfg.parallelism)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = dims.build_mesh(device.type, cfg.comm.init_timeout_seconds)
    torch.manual_seed(cfg.job.seed)
    built = build_model(
        model_args(cfg, None), cfg, mesh, dims, device, Toggles(), pipeline_loss(cfg), per_stage_seed=per_stage
    )
    ids = [s.stage_index for s in built.stages] if built.schedule is not None else [0]
    stages = {}
    for sid, part in zip(ids, built.parts, strict=True):
        params = {}
        for name, p in part.named_parameters():
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            local = p.to_local() if isinstance(p, DTensor) else p
            params[name] = (_digest(whole), _digest(local))
        stages[sid] = params
    mine = {"rank": dist.get_rank(), "pp_rank": mesh["pp"].get_local_rank(), "stages": stages}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone} if dist.get_rank() == 0 else None


def check_init(report: dict) -> list[str]:
    """What is wrong with an init_report (empty: nothing)."""
    problems = []
    by_stage: dict[int, dict[str, set]] = {}
    locals_: dict[tuple[int, str], dict[str, list[int]]] = {}  # local digest -> ranks
    for r in report["ranks"]:
        for sid, params in r["stages"].items():
            for name, (whole, local) in params.items():
                by_stage.setdefault(int(sid), {}).setdefault(name, set()).add(whole)
                locals_.setdefault((int(sid), name), {}).setdefault(local, []).append(r["rank"])
    for sid, params in sorted(by_stage.items()):
        for name, wholes in params.items():
            if len(wholes) != 1:
                problems.append(f"stage {sid}: ranks disagree on {name} ({len(wholes)} different values)")
    # blocks: the k-th block of every stage; depth-scaled weights differ by their scale alone, so
    # one weight drawn alike (wq: std 0.02 in every block) is a repeat
    seen: dict[tuple[int, str, str], int] = {}
    for sid, params in sorted(by_stage.items()):
        layers = sorted({n.split(".")[1] for n in params if n.startswith("layers.")}, key=int)
        for k, layer in enumerate(layers):
            for name, wholes in params.items():
                if not name.startswith(f"layers.{layer}.") or "norm" in name:
                    continue
                key = (k, name.split(".", 2)[2], next(iter(wholes)))
                if key in seen:
                    problems.append(f"stage {sid}: {name} (block {k}) repeats block {k} of stage {seen[key]}")
                seen.setdefault(key, sid)
    for (sid, name), shards in locals_.items():
        sharded = any(local != whole for local in shards for whole in by_stage[sid][name])
        if sharded and "norm" not in name and len(shards) == 1 and len(next(iter(shards.values()))) > 1:
            problems.append(f"stage {sid}: every shard of {name} holds the same values")
    return problems


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.studies.preflight --worker init")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--same-seed-every-stage",
        action="store_true",
        help="torch's lazy default (one seed broadcast to all): shows the defect",
    )
    a, overrides = parser.parse_known_args(argv)
    import torch.distributed as dist  # local: as above

    from core.noise import quiet_library_warnings

    quiet_library_warnings()
    report = init_report(overrides, per_stage=not a.same_seed_every_stage)
    if report is not None:
        atomic_write_json(a.out, report, indent=None)
    dist.destroy_process_group()
    return 0


def run_init_check(
    world: int, overrides: list[str], out: Path, same_seed: bool = False, timeout: float = 300, mode: str = "proxy"
) -> dict:
    """Launch the init worker on `world` ranks (CPU in proxy mode, GPUs in real mode); returns its report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    target = [
        "-m",
        "recipes.studies.preflight",
        "--worker",
        "init",
        "--out",
        str(out),
        *(["--same-seed-every-stage"] if same_seed else []),
        *overrides,
    ]
    log = out.with_suffix(".log")
    rc = launcher.run_logged(
        launcher.torchrun_command(world, target, forked=mode == "proxy"),
        modes.MODES[mode]().env(world, max_restarts=0, **({"OMP_NUM_THREADS": "1"} if mode == "proxy" else {})),
        log,
        timeout=timeout,
    )
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"init worker failed (exit {rc}); log {log}:\n{launcher.log_tail(log)}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------- runs
@dataclass
class Verdict:
    feature: str
    status: str  # PASS | FAIL | SKIP
    detail: str = ""


@dataclass
class Preflight:
    out: Path
    real: bool  # CUDA here: the real form (NCCL, GPUs); else the CPU proxy form
    verdicts: list[Verdict] = field(default_factory=list)
    runs: dict[str, dict] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "real" if self.real else "proxy"

    def verdict(self, feature: str, ok: bool, detail: str = "") -> None:
        self.verdicts.append(Verdict(feature, "PASS" if ok else "FAIL", detail))
        click.echo(f"  {'PASS' if ok else 'FAIL'}  {feature}" + (f": {detail}" if detail else ""))

    def skip(self, feature: str, reason: str) -> None:
        self.verdicts.append(Verdict(feature, "SKIP", reason))
        click.echo(f"  SKIP  {feature}: {reason}")

    def train(self, name: str, world: int, overrides: list[str], timeout: float = 600) -> dict | None:
        """One trainer run (torchrun via recipes.launcher); its record, or None (a FAIL verdict)."""
        out = self.out / name
        out.mkdir(parents=True, exist_ok=True)
        target = launcher.trainer_target(None, [*overrides, f"--job.output_dir={out}", f"--job.mode={self.mode}"])
        env = modes.MODES[self.mode]().env(world, max_restarts=0, **({} if self.real else {"OMP_NUM_THREADS": "1"}))
        t0 = time.perf_counter()
        cmd = launcher.torchrun_command(world, target, forked=not self.real)
        rc = launcher.run_logged(cmd, env, out / "train.log", timeout=timeout)
        result = out / "result.json"
        if rc != 0 or not result.is_file():
            self.verdict(
                f"run {name} ({world} ranks)",
                False,
                f"exit {rc}; log {out / 'train.log'}:\n{launcher.log_tail(out / 'train.log', 15)}",
            )
            return None
        rec = json.loads(result.read_text())
        self.runs[name] = rec
        if not rec["losses"]:  # a seed checkpoint run: the initial weights saved, nothing trained
            click.echo(f"  [{name}] {world} ranks, {time.perf_counter() - t0:.0f} s: the initial weights saved")
            return rec
        first = rec.get("first_step_peak_memory_gib")
        click.echo(
            f"  [{name}] {world} ranks, {time.perf_counter() - t0:.0f} s: step {_mean(rec) * 1e3:.0f} ms "
            f"(data {1e3 * (rec.get('data_time_s') or 0):.1f} ms), "
            f"{rec['tokens_per_sec_per_device']:,.0f} tokens/s/device, peak memory "
            f"{rec['peak_memory_gib']:.2f} GiB"
            + (f" (first step {first:.2f})" if first is not None else "")
            + f" [{rec.get('memory_kind', '')}]"
        )
        return rec


def _mean(rec: dict) -> float:
    steady = rec["step_times_s"][1:] or rec["step_times_s"]
    return sum(steady) / len(steady)


def _finite(losses: list[float]) -> bool:
    return bool(losses) and all(math.isfinite(x) for x in losses)


def run_preflight(out: Path, real: bool) -> Preflight:
    pf = Preflight(out, real)
    click.echo(f"preflight ({pf.mode} form) in {out}")
    ref, seed = _single_process(pf)
    _meta_init(pf)
    _three_d(pf, ref, seed)
    _cp_float8_dcp(pf)
    if not real:
        pf.skip("NCCL", "no CUDA device here: the proxy runs gloo")
        pf.skip("Float8 matmuls (sm89+)", "no float8 GPU here: torchao's emulation ran instead")
    return pf


def _single_process(pf: Preflight) -> tuple[dict | None, Path]:
    """1. One process: the reference losses, and the seed checkpoint every layout loads (compiled:
    one process compiles in seconds where four ranks on a few cores take minutes)."""
    seed = pf.out / "seed" / "checkpoint" / "step-0"
    pf.train("seed", 1, [*BASE, "--checkpoint.enabled=true", "--checkpoint.create_seed_checkpoint=true"])
    ref = pf.train(
        "single",
        1,
        [
            *BASE,
            "--checkpoint.enabled=true",
            f"--checkpoint.resume_from={seed}",  # the initial weights every layout loads
            f"--checkpoint.interval={STEPS}",
            "--compile.enabled=true",
        ],
    )
    if ref is not None:
        pf.verdict(
            "single process + seed checkpoint",
            _finite(ref["losses"]) and seed.is_dir(),
            f"losses {ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f}",
        )
        pf.verdict("compile (per block)", "compile" in ref["toggles_applied"])
    return ref, seed


def _meta_init(pf: Preflight) -> None:
    """2. The meta init path on FSDP x TP x PP: per-stage seeds, consistent ranks."""
    feature = "meta-device init (FSDP 2 x TP 2 x PP 2, per-stage seeds)"
    try:
        report = run_init_check(8, [*BASE, *LAYOUT_3D, *META], pf.out / "meta_init" / "report.json", mode=pf.mode)
        problems = check_init(report)
        pf.verdict(
            feature, not problems, "; ".join(problems[:3]) or "stages distinct, ranks of a stage agree, shards distinct"
        )
    except RuntimeError as e:
        pf.verdict(feature, False, str(e)[-600:])


def _three_d(pf: Preflight, ref: dict | None, seed: Path) -> None:
    """3. 3D with Interleaved 1F1B on the meta path, from the seed checkpoint: parity with 1D."""
    load_seed = ["--checkpoint.enabled=true", f"--checkpoint.resume_from={seed}", f"--checkpoint.interval={STEPS}"]
    rec = pf.train("3d", 8, [*BASE, *LAYOUT_3D, *META, *load_seed]) if seed.is_dir() else None
    if rec is None:
        return
    pf.verdict(
        "FSDP x TP x PP, Interleaved 1F1B",
        "pp:Interleaved1F1B" in rec["toggles_applied"] and {"fsdp", "tp"} <= set(rec["toggles_applied"]),
        ", ".join(rec["toggles_applied"]),
    )
    if ref is not None:
        diff = max(abs(a - b) for a, b in zip(rec["losses"], ref["losses"], strict=False))
        tol = PARITY_TOL_REAL * max(map(abs, ref["losses"])) if pf.real else PARITY_TOL
        pf.verdict(
            "loss parity 3D (eager) vs single process (compiled), from the seed checkpoint",
            len(rec["losses"]) == len(ref["losses"]) and diff <= tol,
            f"max |diff| {diff:.2e} (tolerance {tol:g})",
        )


def _cp_float8_dcp(pf: Preflight) -> None:
    """4. CP + TP with Float8 (TP styles), AsyncTP, DCP saves; then a resume."""
    feats = [
        "--parallelism.cp=2",
        "--parallelism.tp=2",
        "--training.local_batch_size=8",
        "--float8.enabled=true",
        f"--float8.emulate={'false' if pf.real else 'true'}",
        "--checkpoint.enabled=true",
        "--checkpoint.interval=2",
    ]
    # AsyncTP is an inductor pass (compile) needing CUDA symmetric memory: on GPUs this run compiles
    # and turns it on; elsewhere the trainer's own hardware check says why it cannot run
    async_tp = ["--compile.enabled=true", "--parallelism.enable_async_tp=true"]
    async_problem = None
    if pf.real:
        feats += async_tp
    else:
        from core.config import load_config  # local: `run-recipe --help` must not import torch
        from core.toggles.async_tp import hardware_problem

        async_problem = hardware_problem(load_config(None, [*BASE, *feats, *async_tp]))
    rec = pf.train("cp_float8", 4, [*BASE, *feats])
    if rec is None:
        return
    _cp_float8_verdicts(pf, rec, async_problem)
    again = pf.train("cp_float8", 4, [*BASE, *feats, f"--training.steps={STEPS + 2}"])
    if again is not None:
        pf.verdict(
            "DCP save + load (resume)",
            again["start_step"] == STEPS and len(again["losses"]) == 2 and _finite(again["losses"]),
            f"resumed at step {again['start_step']}",
        )


def _cp_float8_verdicts(pf: Preflight, rec: dict, async_problem: str | None) -> None:
    """What the CP 2 x TP 2 Float8 run applied: CP, Float8 linears, Float8 TP styles, AsyncTP."""
    applied, skipped = set(rec["toggles_applied"]), rec["toggles_skipped"]
    pf.verdict(
        "context parallel (CP 2 x TP 2)",
        rec["config"]["parallelism"]["cp"] == 2 and _finite(rec["losses"]),
        f"losses {rec['losses'][0]:.4f} -> {rec['losses'][-1]:.4f}",
    )
    pf.verdict("Float8 linears", "float8" in applied, ", ".join(sorted(a for a in applied if "float8" in a)))
    if async_problem:
        skipped = {**skipped, "async_tp": async_problem}
    for name, feature in (("float8_tp", "Float8 TP styles"), ("async_tp", "AsyncTP")):
        if name in applied:
            pf.verdict(feature, True)
        elif name in skipped and not pf.real:
            pf.skip(feature, skipped[name])
        else:
            pf.verdict(feature, False, skipped.get(name, "not applied"))


@click.command("preflight")
@out_dir_option("Folder of the runs (default runs/preflight/<timestamp>).", name="out")
@one_device_options
def preflight(
    out: str | None, gpus: int | None, device: str, rounds: int, steps: int, threads: int, layers: int, quick: bool
) -> None:
    """One node, a few minutes: every feature the rows need, a verdict each, 1D parity. With
    --gpus 1: this device measured, a one-device step predicted on its spec and compared."""
    import torch  # local: `run-recipe --help` must not import torch

    if gpus is None:  # the one-device form's options, which the node's check would ignore
        ctx = click.get_current_context()
        given = [
            p.opts[0]
            for p in ctx.command.params
            if p.name not in ("out", "gpus", "help") and ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE
        ]
        if given:
            refuse(f"error: {', '.join(given)}: only with --gpus 1 (the one-device form); the node's check takes --out")
    if gpus is not None:
        if gpus != 1:
            raise click.BadParameter(
                f"{gpus}: only 1 (the one-device form); omit --gpus for the node's check", param_hint="--gpus"
            )
        from recipes.studies.preflight_one import one_device

        folder = Path(out) if out else paths.default_runs_dir() / "preflight" / time.strftime("%Y%m%d-%H%M%S-gpus1")
        check_writable("--out", folder)
        sys.exit(one_device(folder.resolve(), rounds, steps, quick, threads, device, layers))
    # the real form needs one node of 8 GPUs (the 3D layout); anything less runs the CPU proxy form
    real = torch.cuda.is_available() and torch.cuda.device_count() >= 8
    if torch.cuda.is_available() and not real:
        click.echo(f"{torch.cuda.device_count()} GPUs here, 8 needed for the real form: running the CPU proxy form")
    folder = Path(out) if out else paths.default_runs_dir() / "preflight" / time.strftime("%Y%m%d-%H%M%S")
    check_writable("--out", folder)
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pf = run_preflight(folder, real)
    failed = [v for v in pf.verdicts if v.status == "FAIL"]
    summary = {
        "mode": pf.mode,
        "wall_s": time.perf_counter() - t0,
        "verdicts": [v.__dict__ for v in pf.verdicts],
        "passed": not failed,
    }
    (folder / "preflight.json").write_text(json.dumps(summary, indent=2) + "\n")
    counts = {s: sum(v.status == s for v in pf.verdicts) for s in ("PASS", "FAIL", "SKIP")}
    click.echo(
        f"preflight: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
        f"(cannot run here) in {summary['wall_s']:.0f} s; {folder / 'preflight.json'}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if sys.argv[1:3] != ["--worker", "init"]:
        sys.exit("usage: run-recipe preflight (this module's own entry is the torchrun worker)")
    from core.process import exit_process

    exit_process(_worker_main(sys.argv[3:]))
