"""`run-recipe plan` sizes each candidate with the memory accounting's band for its kind
(core/dryrun/accuracy.py memory_band): one that fits only without it is refused, and says so."""

from __future__ import annotations

from click.testing import CliRunner


def test_plan_refuses_a_layout_that_fits_only_without_its_memory_band():
    """A candidate fits when its estimate plus the memory band of its kind (the accounting's error
    over the public readings of that kind, results/memory_validation.md) fits; one that fits only
    without the band is refused and said to be within its band of the limit."""
    import json

    from recipes.cli import main

    def ranked(gpu_mem: float) -> dict:
        args = ["plan", "--model", "8B", "--gpus", "8", "--local-batch", "1", "--no-compile", "--json"]
        res = CliRunner().invoke(main, [*args, "--gpu-mem", str(gpu_mem)], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return next(c for c in json.loads(res.output) if c["layout"] == "FSDP 8")

    roomy = ranked(200.0)
    band = roomy["memory_band_pct"]
    assert band is not None and band > 0, "the memory validation gives the kind a band"
    need = roomy["estimate_gib"]
    assert roomy["fits"] and not roomy["within_memory_band_of_limit"]
    assert roomy["ac"] == "none"
    tight = ranked(round(need * (1 + band / 200), 2))  # above the estimate, below estimate + band
    assert tight["ac"] == "selective" and tight["fits"], "no AC is refused: it fits only without its band"
    # The full-AC fallback when nothing fits with its band says how close it came.
    from recipes.plan.layouts import candidates

    full = candidates("8B", 8, 8192, 1.0, local_batch=1, compile_=False)[0]
    assert not full.fits and not full.near_limit and full.fit_text() == "no"
    full_need = full.estimate_gib
    near = next(
        c
        for c in candidates("8B", 8, 8192, full_need * (1 + full.memory_band / 2), local_batch=1, compile_=False)
        if c.degrees == full.degrees
    )
    assert not near.fits and near.near_limit and "within" in near.fit_text()
