"""From records to what a person reads: every file `run-recipe results`, `dry-run-table` and
`benchmark-report` write under results/, and the README's recipe table.

- results.py          `run-recipe results`: every paper table (.md, .csv, .png) and results/README.md
- table_data.py       the records and the paper's figures as one frame per table
- figures.py          the tables' PNGs
- loss_curves.py      the loss-convergence table and plot
- dryrun_table.py     `run-recipe dry-run-table`: results/dry_run.{md,csv}, --predict, --validate
- perf_validation.py  the performance model against every public figure (perf_figures.toml)
- benchmarks.py       `run-recipe benchmark-report`: results/benchmarks/<date>-<cpu>.md
- readme.py           the README's recipe table (`python -m recipes.report.readme`)
- templates/          the words of the generated pages
"""
