"""The commands of a run on more than one node: the torchrun line to start on every node and the
SLURM sbatch script (its environment lines: recipes/cluster_env.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

from core.config import JobConfig
from recipes.cluster_env import sbatch_env_lines
from recipes.launcher import project_root, torchrun_command, torchrun_exe, trainer_target
from recipes.schema import Recipe

RDZV_PORT = 29500


def multinode_command(
    nnodes: int, nproc: int, config_path: Path, rdzv_id: str, endpoint: str = f"$HOST:{RDZV_PORT}"
) -> str:
    """The command to run on every node; HOST is the first node's address."""
    cmd = torchrun_command(
        nproc,
        trainer_target(shlex.quote(str(config_path))),
        nnodes=nnodes,
        rdzv_id=rdzv_id,
        rdzv_endpoint=endpoint,
        exe="torchrun",
    )
    return " ".join(cmd)


def sbatch_script(
    recipe: Recipe,
    cfg: JobConfig,
    run_dir: Path,
    nnodes: int,
    nproc: int,
    records_dir: Path | None,
    extra: list[str] | tuple[str, ...] = (),
) -> str:
    q = shlex.quote
    cmd = torchrun_command(
        nproc,
        trainer_target(q(str(run_dir / "job.json"))),
        nnodes=nnodes,
        rdzv_id='"$SLURM_JOB_ID"',
        rdzv_endpoint=f'"$head_node:{RDZV_PORT}"',
        exe=q(torchrun_exe()),
        launcher_args=["$numa_flag"],
    )
    # one shell line per group: executable | nodes, ranks, CPU binding | rendezvous | what each rank runs
    exe, dims, rdzv, target = cmd[:1], cmd[1:4], cmd[4:7], cmd[7:]
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
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        *[f"#SBATCH {opt if opt.startswith('--') else '--' + opt}" for opt in extra],
        "",
        "set -euo pipefail",
        f"cd {q(str(project_root()))}",
        f"export PYTHONPATH={q(str(project_root()))}${{PYTHONPATH:+:$PYTHONPATH}}",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        *sbatch_env_lines(nproc),
        # one task per node runs torchrun and its ranks: give it every core of the node (srun does
        # not inherit sbatch's CPU count); $numa_flag stays unquoted: empty, it is no argument
        (
            f'srun --nodes={nnodes} --ntasks-per-node=1 --cpus-per-task="$cpus_per_node" --cpu-bind=none '
            f"{' '.join(exe)} \\"
        ),
        f"    {' '.join(dims)} \\",
        f"    {' '.join(rdzv)} \\",
        f"    {' '.join(target)}",
    ]
    if records_dir is not None:
        dest = records_dir / "real" / f"{recipe.fname}.json"
        lines += [f"mkdir -p {q(str(dest.parent))}", f"cp {q(str(run_dir / 'result.json'))} {q(str(dest))}"]
    return "\n".join(lines) + "\n"
