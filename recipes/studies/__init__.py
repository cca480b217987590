"""Studies: measurements around the run path, each a `run-recipe` subcommand.

parity (loss parity of N-D layouts vs one process), convergence (the loss-convergence rows),
bench (trainer overhead, MFU, FSDP memory; runs toggles_bench and checkpoint_bench too),
toggles_bench, checkpoint_bench, cp_memory. group_worker runs several trainer jobs inside one
torchrun (parity's grouped runs). parity_layouts and parity_tables are parity's layouts and
tables; toggles_interleaved, toggles_probe (the cold-compile subprocess) and toggles_float8 are
parts of toggles_bench. Studies use the run path (launcher, results); it never
imports them (the CLI finds them by name).
"""
