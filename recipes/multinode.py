"""The commands of a run on more than one node: the torchrun line to start on every node and the
SLURM sbatch script (its environment lines: recipes/cluster_env.py).

Every value written here is one line of visible text (the options were checked as click parsed
them: recipes/options.py one_line; `_one_line` refuses anything else before a script is made) and
every path is shell-quoted, so nothing a user names can become a line of the script."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from core.config import JobConfig
from core.run_folder import RUN_LOCK_ENV
from recipes.cluster_env import node_env_assignments, sbatch_env_lines
from recipes.launcher import torchrun_command, torchrun_exe, trainer_target
from recipes.options import control_char
from recipes.paths import project_root
from recipes.schema import Recipe

RDZV_PORT = 29500


def multinode_command(
    nnodes: int,
    nproc: int,
    config_path: Path,
    rdzv_id: str,
    endpoint: str = f"$HOST:{RDZV_PORT}",
    max_restarts: int = 0,
) -> str:
    """The command to run on every node, with the environment a local launch and the sbatch
    script set (recipes/cluster_env.py); HOST is the first node's address."""
    _one_line(config_path, rdzv_id, endpoint)
    cmd = torchrun_command(
        nproc,
        trainer_target(shlex.quote(str(config_path))),
        nnodes=nnodes,
        rdzv_id=rdzv_id,
        rdzv_endpoint=endpoint,
        max_restarts=max_restarts,
        exe="torchrun",
    )
    return " ".join([*node_env_assignments(max_restarts), *cmd])


SRUN_WAIT_S = 60  # seconds srun waits for the other tasks after the first one ends


def _one_line(*texts: str | Path) -> None:
    """A value with a newline or another control character never reaches a script (ValueError)."""
    for text in texts:
        bad = control_char(str(text))
        if bad:
            raise ValueError(f"not written into a script: {bad}")


def in_double_quotes(text: str) -> str:
    """`text` inside a shell's double quotes, read back as given: $ ` " and \\ escaped."""
    return re.sub(r'([$`"\\])', r"\\\1", text)


def python_env_lines() -> list[str]:
    """The job states the Python environment it runs (this one's interpreter) and stops before srun
    when that environment's torch has no CUDA (a CPU build would train on the nodes' CPUs)."""
    _one_line(sys.prefix, sys.executable)
    py, prefix = shlex.quote(sys.executable), in_double_quotes(sys.prefix)
    show = shlex.quote('import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')
    check = shlex.quote("import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)")
    return [
        f"# Python environment: {sys.prefix} ({sys.executable})",
        f'echo "run-recipe: Python environment {prefix}: $({py} -c {show})"',
        f'{py} -c {check} || {{ echo "run-recipe: the torch of {prefix} has no CUDA on $(hostname) '
        '(a CPU build, or no GPU): not starting" >&2; exit 3; }',
    ]


def sbatch_script(
    recipe: Recipe,
    cfg: JobConfig,
    run_dir: Path,
    nnodes: int,
    nproc: int,
    records_dir: Path | None,
    extra: list[str] | tuple[str, ...] = (),
    max_restarts: int = 0,
) -> str:
    q = shlex.quote
    _one_line(run_dir, records_dir or "", project_root(), torchrun_exe(), *extra)
    cmd = torchrun_command(
        nproc,
        trainer_target(q(str(run_dir / "job.json"))),
        nnodes=nnodes,
        rdzv_id='"$SLURM_JOB_ID"',
        rdzv_endpoint=f'"$head_node:{RDZV_PORT}"',
        max_restarts=max_restarts,
        exe=q(torchrun_exe()),
        launcher_args=["$numa_flag"],
    )
    # one shell line per group: executable | nodes, ranks, CPU binding | rendezvous (and restarts) | what each rank runs
    target_at = cmd.index("-m")
    exe, dims, rdzv, target = cmd[:1], cmd[1:4], cmd[4:target_at], cmd[target_at:]
    lines = [
        "#!/bin/bash",
        (
            f"# run-recipe: {recipe.id} (real), {cfg.parallelism.world_size} GPUs = "
            f"{nnodes} nodes x {nproc}. One torchrun per node, rendezvous on the first node."
        ),
        f"#SBATCH --job-name={recipe.fname}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc}",
        "#SBATCH --exclusive",
        *[f"#SBATCH {opt if opt.startswith('--') else '--' + opt}" for opt in extra],
        "",
        "set -euo pipefail",
        # the job's output in the run folder: a shell-quoted redirection, not #SBATCH --output=,
        # which sbatch reads by quoting rules of its own and where it expands every %
        f'exec >{q(str(run_dir))}/slurm-"$SLURM_JOB_ID".out 2>&1',
        f"cd {q(str(project_root()))}",
        *python_env_lines(),
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        *sbatch_env_lines(nproc, max_restarts),
        f"export {RUN_LOCK_ENV}=1  # rank 0 owns the run folder while the job runs",
        # one task per node runs torchrun and its ranks: give it every core of the node (srun does
        # not inherit sbatch's CPU count); $numa_flag stays unquoted: empty, it is no argument.
        # --kill-on-bad-exit: one node's torchrun dying ends the job (the others would wait in the
        # rendezvous, which no watchdog covers); --wait: the rest end within a minute of the first.
        (
            f'srun --nodes={nnodes} --ntasks-per-node=1 --cpus-per-task="$cpus_per_node" --cpu-bind=none '
            f"--kill-on-bad-exit=1 --wait={SRUN_WAIT_S} {' '.join(exe)} \\"
        ),
        f"    {' '.join(dims)} \\",
        f"    {' '.join(rdzv)} \\",
        f"    {' '.join(target)}",
    ]
    if records_dir is not None:
        dest = records_dir / "real" / f"{recipe.fname}.json"
        lines += [f"mkdir -p {q(str(dest.parent))}", f"cp {q(str(run_dir / 'result.json'))} {q(str(dest))}"]
    return "\n".join(lines) + "\n"
