"""True scale without GPUs: memory accounting, fake step, the dry-run record."""
