"""torchrun for proxy runs on one machine, with the ranks forked from a process that has already
imported what they run.

    python -u -m recipes.forked_run [torchrun options] -m MODULE [args...]

It takes torchrun's options and gives torchrun's behaviour: torch's own argument parser, launch
config, elastic agent, c10d rendezvous and restarts. One thing differs: each rank is a fork of
this process running `python -m MODULE args` (runpy), not a new interpreter. The ranks no
longer import torch and the trainer one by one on a few cores: 2.5 s of CPU each. An 8-rank
proxy launch measured 16-17.6 s under torchrun and 6.0-6.4 s here, with the same losses.
Real runs keep torchrun: GPUs, and the workers of a real cluster, get fresh processes. The ranks'
store is rank 0's own, never the agent's shared one (see main).

MODULE is imported here, so its top level must only define things (its work under
`if __name__ == "__main__"`). If it has `before_fork(args)`, that runs here too, to import what the
ranks would import lazily (core.train, group_worker: inductor and torchao for compiled and Float8
jobs) and, for compiled jobs, compute what each rank's first compile computes alike (the CPU's
vector ISA, the hash of torch's sources, the precompiled header). No thread may be alive at the fork.
"""

from __future__ import annotations

import gc
import importlib
import os
import runpy
import signal
import sys
import uuid
import warnings

from core.process import die_with_parent, forget_rank_deaths
from recipes.cluster_env import UNSHARED_STORE_ENV
from recipes.reserved_port import use_reserved_ports

# torch elastic's agent turns these into a SignalException (its own shutdown path).
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _signals_as_in_a_new_interpreter() -> None:
    """A rank torchrun starts has Python's defaults for the signals the agent handles (handlers
    end at exec); a fork would keep the agent's. Kept, the agent's SIGTERM to stop the rank became
    an exception in whatever the rank ran, which may catch it (DCP gathers a save's exceptions
    across ranks, then waits in a collective) and the rank lived on until the agent's SIGKILL."""
    for sig in AGENT_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _run_module_as_main(module: str, argv: list[str]) -> None:
    """What `python -m module argv...` does, in a forked rank (stopped if the agent dies)."""
    _signals_as_in_a_new_interpreter()
    die_with_parent()
    forget_rank_deaths()
    sys.argv = [module, *argv]
    with warnings.catch_warnings():  # "found in sys.modules": imported on purpose, by the parent
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
    # The imports below make objects that live as long as the process (0.25-0.45 M: torch, the
    # trainer, inductor); the collector would walk them all, here while importing and in every
    # full collection of each rank, whose walks also copy the pages they share with this process.
    # So: no collection while importing, and what was made frozen out of the collector's reach
    # before the fork (Python's gc.freeze recipe for forks). The ranks collect their own objects.
    gc.disable()
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    die_with_parent()  # a launcher killed outright takes its agent, and so its ranks, with it
    # No shared rendezvous store here: its server is a thread of this process, busy with the first
    # ranks while the next are forked, and a rank forked while that thread held a lock hung in its
    # store client (16 ranks: 1 launch in 80 under load; 0 in 80 with rank 0's own store).
    os.environ[UNSHARED_STORE_ENV] = "1"
    use_reserved_ports()  # so rank 0's port waits for it
    args = parse_args(argv)
    if not (args.module and args.standalone):
        sys.exit("recipes.forked_run: runs `--standalone ... -m MODULE` only (one node); use torchrun otherwise")
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())  # as --standalone
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    module = importlib.import_module(args.training_script)  # imported once here; every fork inherits it
    if hasattr(module, "before_fork"):  # what the module's jobs import lazily, imported once too
        module.before_fork(list(args.training_script_args))
    from core.process import FORKED_AT_AGE_ENV, process_age_s, watch_rank_deaths

    os.environ[FORKED_AT_AGE_ENV] = f"{process_age_s() or 0.0:.3f}"  # the ranks' records count it
    watch_rank_deaths()  # a rank killed outright is named the moment it dies
    gc.freeze()
    gc.enable()
    elastic_launch(config, _run_module_as_main)(args.training_script, list(args.training_script_args))


if __name__ == "__main__":
    main()
