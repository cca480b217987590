"""`python -m core.checkpoint`: the single-process tools (core/checkpoint/files.py `main`)."""

import sys

from core.checkpoint.files import main

sys.exit(main())
