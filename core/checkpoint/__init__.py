"""Distributed checkpoints (torch.distributed.checkpoint), one concept in one package:

- checkpointer.py  the Checkpointer: save (sync or async), load, resume, keep-latest-k, seed and
                   model-only saves; what the trainer calls
- state.py         what a checkpoint holds: one DCP `Stateful` per kind of state, the keys on disk
- folder.py        the folder's layout and names, what makes a checkpoint complete (torch-free:
                   the launcher reads a run's checkpoints through it before anything is spawned)
- manifest.py      every file's size and CRC32, written last, checked before a load (torch-free)
- collectives.py   what the ranks do together on the checkpoint's own process group
- files.py         a checkpoint's contents without a process group: checks before a load, DCP's
                   errors in one line, full weights, Hugging Face export / import, the command
                   line (`python -m core.checkpoint`)
- trusted.py       the one reader of a checkpoint's files: `.metadata` and non-tensor items
                   through allowlists, so loading never runs what it reads
"""
