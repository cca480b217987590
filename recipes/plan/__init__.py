"""`run-recipe plan`: layouts for a model and a GPU count ranked by predicted speed, and the GPU
count a token budget needs.

- layouts.py    the command, the candidate layouts, their memory check and ranking
- budget.py     `plan --tokens --days`: the smallest whole-node count that finishes in time
- report.py     what `plan --gpus N` prints (table, JSON, the paper's layouts among them), rates and days
- candidate.py  one proposed layout (named by the three others without an import cycle)
"""
