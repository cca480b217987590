#!/usr/bin/env bash
# One-time set-up (idempotent): a virtual environment at .venv, torch pinned first (a bare
# `torch` requirement would pull a multi-GB CUDA build), the project and its test extras,
# then the offline assets (proxy tokenizer, C4-layout corpus, Llama 3 tokenizer) under assets/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
echo "[setup] torch ($TORCH_SPEC)"
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "$TORCH_SPEC"
echo "[setup] titan-recipes and its dependencies"
.venv/bin/pip install -q -e ".[test]"
echo "[setup] offline assets"
.venv/bin/python -m core.data.assets --all
echo "[setup] done: .venv/bin/run-recipe list"
