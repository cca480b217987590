"""`python -m recipes ...`: `run-recipe` itself (recipes/entry.py)."""

from recipes.entry import main

main()
