"""torchrun's agent for a launch on this node, tethered to the launcher that started it:

    python -m recipes.agent [torchrun options] -m core.train --config job.json

torch's own `torch.distributed.run` (parser, elastic agent, rendezvous, restarts), after asking the
kernel for a SIGTERM when its parent dies (core/process.py `die_with_parent`): a launcher killed
outright (SIGKILL, the OOM killer, a closed SSH session) cannot leave its ranks training, and
writing into the run folder, unsupervised. torchrun stops its ranks on that SIGTERM as on any.
A rank killed by a signal is named in an error line the moment it dies (core/process.py
`RankDeaths`): it leaves no error of its own, and torchrun may first see a survivor's. Rank 0's
port, where it serves its own store, is reserved until it binds it (recipes/reserved_port.py).
"""

from __future__ import annotations

import sys

from core.process import die_with_parent, watch_rank_deaths
from recipes.reserved_port import use_reserved_ports


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    watch_rank_deaths()  # a rank killed outright is named the moment it dies
    from torch.distributed.run import main as torchrun_main

    use_reserved_ports()  # rank 0's own store (--max-restarts) binds a port no one took meanwhile

    torchrun_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
