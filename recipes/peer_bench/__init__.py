"""Side-by-side throughput with torchtitan 0.3.0 on a CPU (`run-recipe peer-bench`): the command
(command.py), the peer's environment (environment.py), its CPU patches (patches.py), the runs and
the CSV (runs.py), and the tokenizer build the peer's interpreter runs (tokenizer_build.py)."""
