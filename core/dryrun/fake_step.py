"""The fake step: one process pretends to be rank 0 of the row's world.

A fake process group (torch's `FakeStore` + "fake" backend) stands in for the cluster, the mesh is
`init_device_mesh` with the real degrees, the row's real model is built on the meta device and
the project's own `parallelize` / `build_pipeline` shard it; then, under `FakeTensorMode` (tensors
with shapes and no storage), the trainer's own `forward_backward` (or, with PP, this rank's share
of the schedule in the schedule's own action order, through the library's stage backward and
gradient-reduction calls), grad clipping and the AdamW step run. That proves the layout composes.
torch's `FSDPMemTracker` / `MemTracker` measure the step where affordable (eager semantics on this
CPU: what the fake step cannot run -- inductor, symmetric memory -- is named in
`toggles_modelled`).
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

import torch
import torch.distributed as dist

# private, no public equivalents: fake tensors, FSDP2's memory tracker, the fake process group's
# store (torch's own tests use them the same way); tests/test_torch_internals.py guards them
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from core.build import build_model
from core.dryrun.memory import GIB
from core.models.args import model_args
from core.noise import quiet_library_warnings
from core.optim import build_optimizer, clip_grad_norm_
from core.parallel.context import loss_parallel_context, step_context
from core.parallel.mesh import ParallelDims
from core.parallel.parallelize import Toggles
from core.parallel.schedule_sim import pipeline_order
from core.parallel.stages import pp_microbatches, stages_per_rank
from core.step import TrainStep, pipeline_loss
from core.toggles.float8 import post_optimizer_hook

T = TypeVar("T")


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of `world_size` ranks in which this process is `rank` and every
    collective is a no-op (torch's fake backend). Replaces an earlier fake group; refuses to
    touch a real one."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(
                "a real process group is initialised in this process: dry-run needs its own (run it outside torchrun)"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def _lean(tracker_cls, module_stats: bool = True):
    """torch's tracker keeping only the global peak: the stock one also refreshes every module's
    peak on every op, which costs minutes on 100+ blocks and is not used here. Without
    module_stats its per-module hooks are off too (a pipeline rank calls each stage once per
    microbatch, which the stock tracker takes for a second iteration); totals are unchanged."""

    class Lean(tracker_cls):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        if not module_stats:

            def _pre_fw_hook(self, module, inputs):
                pass

            def _post_fw_hook(self, module, inputs, outputs):
                pass

            def _pre_bw_hook(self, module, args):
                pass

            def _post_bw_hook(self, module, args):
                pass

    Lean.__name__ = f"Lean{tracker_cls.__name__}"
    return Lean


def _snapshot_gib(tracker) -> dict[str, float]:
    snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    return {str(getattr(k, "value", k)).lower().replace(" ", "_"): v / GIB for k, v in snap[dev].items()}


def fake_step(cfg, track: bool | None = None, pp_rank: int = 0, isolate: bool = True) -> dict:
    """Build the row's layout as rank `pp_rank * world / pp` sees it and run one training step
    under FakeTensorMode (a warm-up step, then a tracked one when `track`).

    isolate: in a fresh process (in_a_fresh_process). torch keeps process-wide state across fake
    steps (process-group names in cached meshes, context-parallel dispatch), and a second CP x TP x
    PP layout in the same process can see the first one's: each row gets its own.

    track None: track when there is no pipeline (a PP rank's schedule under the tracker takes
    several minutes at 405B scale). The tracker covers forward + backward + clipping; the AdamW
    step runs untracked, because torch's tracker counts the global-shape tensors DTensor's
    foreach sharding propagation creates under FakeTensorMode as allocations (13x the states).
    Returns what composed, what was applied / skipped / modelled, timings and the tracker peak.
    """
    if isolate:
        return in_a_fresh_process(fake_step, cfg, track, pp_rank, False)

    quiet_library_warnings()
    cfg = copy.deepcopy(cfg)
    modelled = {}
    if cfg.compile.enabled:
        cfg.compile.enabled = False  # inductor cannot compile fake tensors on a fake group
        modelled["compile"] = "not run under FakeTensorMode; its effect on activations is in the accounting"
    dims = ParallelDims.from_config(cfg.parallelism)
    untrackable = None
    if cfg.float8.enabled and cfg.float8.enable_fsdp_float8_all_gather and dims.fsdp_enabled:
        # torchao's float8 weight wrapper tests a tensor's truth value when flattened, which
        # fake tensors cannot answer: the tracker cannot walk those parameters.
        untrackable = "torch's tracker cannot flatten torchao's float8 all-gather weights under FakeTensorMode"
    if track is None:
        track = dims.pp == 1 and untrackable is None
    elif track and untrackable:
        raise ValueError(untrackable)
    rank = pp_rank * (dims.world_size // dims.pp)
    init_fake_process_group(dims.world_size, rank)
    try:
        return _fake_step(cfg, dims, rank, track, untrackable, modelled)
    finally:
        dist.destroy_process_group()  # leave no fake group behind for the caller


def in_a_fresh_process(fn: Callable[..., T], *args) -> T:
    """fn(*args) in a process of its own with a fresh interpreter's state, the caller's environment
    and working directory: a fork of multiprocessing's fork server, which imported this module once
    (a spawned process per call imported torch and the trainer again: 3.5 s of CPU each)."""
    fresh = multiprocessing.get_context("forkserver")
    fresh.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(1, mp_context=fresh) as pool:
        return pool.submit(_as_the_caller, dict(os.environ), os.getcwd(), fn, *args).result()


def _as_the_caller(environ: dict[str, str], cwd: str, fn: Callable[..., T], *args) -> T:
    """A fork of the server has the server's environment and directory, from when it started."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    return fn(*args)


def _fake_step(cfg, dims, rank, track, untrackable, modelled) -> dict:
    t0 = time.perf_counter()
    mesh = dims.build_mesh("cpu")
    device, toggles = torch.device("cpu"), Toggles()
    args = model_args(cfg, None)
    # Meta tensors, sharded by the real functions (DTensors over meta shards), outside the
    # fake mode: the pipeline split deep-copies the model, which fake tensors do not survive.
    built = build_model(args, cfg, mesh, dims, device, toggles, pipeline_loss(cfg), materialize=False)
    # The trainer's own step code, without its data loader, tokenizer or materialised weights.
    tr = TrainStep(cfg, mesh, device, built)
    post_opt = post_optimizer_hook(cfg)
    build_s = time.perf_counter() - t0
    why_not = None if track else (untrackable or "a pipeline rank's schedule under the tracker takes minutes at scale")
    out = {
        "rank": rank,
        "tracked": track,
        "not_tracked_because": why_not,
        "toggles_applied": list(toggles.applied),
        "toggles_skipped": dict(toggles.skipped),
        "toggles_modelled": modelled,
    }
    step_s = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for part in tr.model_parts:
            part.to_empty(device="cpu")  # fake storage-free tensors in place of the meta ones
            part.train()
        optimizer = build_optimizer(tr.model_parts, cfg)
        t = cfg.training
        tokens = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len))
        labels = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len))
        params = [p for m in tr.model_parts for p in m.parameters()]
        pp_group = mesh["pp"].get_group() if dims.pp > 1 else None

        def forward_backward():
            if dims.pp > 1:
                run_pipeline_rank(tr, dims, args, tokens, labels)
            else:
                tr.forward_backward(tokens, labels)
            clip_grad_norm_(params, cfg.training.max_norm, pp_group)

        for i in range(2 if track else 1):
            t1 = time.perf_counter()
            optimizer.zero_grad()
            if i == 1:  # steady state: optimizer states exist, gradients were freed
                tracker = _make_tracker(tr.model_parts, dims, optimizer, tokens, labels)
                with tracker:
                    forward_backward()
                out["tracker_peak_gib"] = _snapshot_gib(tracker)
            else:
                forward_backward()
            optimizer.step()
            if post_opt is not None:
                post_opt(tr.model_parts)
            step_s.append(time.perf_counter() - t1)
    if dims.cp > 1:  # the trainer's CP context ran around forward and backward (not a toggle there)
        out["toggles_applied"].append(f"cp:{cfg.parallelism.cp_rotate_method}")
    out.update(composes=True, build_s=round(build_s, 2), step_s=[round(x, 2) for x in step_s])
    return out


def _make_tracker(model_parts, dims, optimizer, tokens, labels):
    if dims.pp == 1 and isinstance(model_parts[0], FSDPModule):
        tracker = _lean(FSDPMemTracker)(model_parts[0], optimizer)
        tracker.track_inputs((tokens, labels))
    else:
        tracker = _lean(MemTracker, module_stats=False)()
        tracker.track_external(*model_parts, optimizer, tokens, labels)
    return tracker


def run_pipeline_rank(tr: TrainStep, dims: ParallelDims, args, tokens, labels) -> None:
    """This pp rank's share of one schedule step, in the order of the schedule's own action table
    (`core.parallel.schedule_sim.pipeline_order`): forwards on the stage modules, backwards through
    the library's `backward_maybe_with_nosync` (FSDP: no gradient sync, no reshard until the last
    microbatch) and `perform_reduce_grad` at the end. The schedule's runtime itself cannot run
    here: its start-up handshake reads values other ranks send, which a fake group never
    delivers; activations from and gradients to neighbouring stages are fake tensors of the
    shapes those stages produce."""
    cfg = tr.cfg
    p = cfg.parallelism
    n_layers = args.n_layers
    n_micro = pp_microbatches(p, n_layers)
    table = pipeline_order(p.pp_schedule, dims.pp, n_micro, stages_per_rank(p, n_layers))
    actions = table[tr.mesh["pp"].get_local_rank()]
    stages = {s.stage_index: s for s in tr.stages}
    act_dtype = torch.bfloat16 if cfg.training.mixed_precision_param == "bfloat16" else torch.float32
    live = {}
    loss_fn = pipeline_loss(cfg)
    with step_context(cfg, tr.mesh, tokens, labels, tr.model_parts):  # CP shards tokens, labels in place
        xs, ys = tokens.chunk(n_micro), labels.chunk(n_micro)
        mb, seq = xs[0].shape
        seq = seq // dims.tp if dims.tp > 1 else seq  # sequence-parallel hidden states
        hidden = (mb, seq, args.dim)
        # The runtime's receive buffers, one per microbatch: activations into non-first stages,
        # gradients into non-last stages (allocated once, reused every step).
        recv = {
            (sid, m): torch.empty(hidden, dtype=act_dtype, requires_grad=True)
            for sid, st in stages.items()
            if not st.is_first
            for m in range(n_micro)
        }
        grad_recv = {
            (sid, m): torch.empty(hidden, dtype=act_dtype)
            for sid, st in stages.items()
            if not st.is_last
            for m in range(n_micro)
        }
        for a in actions:
            kind, sid, m = a.computation_type.value, a.stage_index, a.microbatch_index
            stage = stages[sid]
            if kind == "F":
                inputs = (xs[m],) if stage.is_first else (recv[(sid, m)],)
                with loss_parallel_context(cfg):
                    output = stage.submod(*inputs)
                    if stage.is_last:
                        output = loss_fn(output, ys[m])
                live[(sid, m)] = (inputs, output)
            elif kind in ("B", "I"):
                inputs, output = live.pop((sid, m))
                grads = None if stage.is_last else grad_recv[(sid, m)]
                with loss_parallel_context(cfg):
                    stage.backward_maybe_with_nosync(
                        "full",
                        {
                            "stage_output": output,
                            "output_grads": grads,
                            "input_values": [x for x in inputs if x.requires_grad],
                        },
                    )
                del inputs, output
        for stage in stages.values():
            stage.perform_reduce_grad(n_micro)
