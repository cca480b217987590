"""`run-recipe plan --tokens N --days D` (recipes/plan/budget.py): the smallest whole-node GPU count
and layout that finish a token budget in time, its refusals, its monotonicity, its speed."""

from __future__ import annotations

import json
import re
import time

import pytest
from click.testing import CliRunner

from core.dryrun.gpuspec import DEFAULT_GPU, load_spec
from recipes.plan.budget import MAX_GPUS, TOKENS, Setup, fastest_tokens_per_gpu, search
from recipes.plan.layouts import best_at, candidates, plan
from recipes.plan.report import days_text

pytestmark = pytest.mark.perfmodel

TOKENS_2T = 2e12


def setup_of(model: str, **kw) -> Setup:
    base = {"seq": 8192, "gpu_mem": 80.0, "local_batch": None, "global_batch": None, "gpus_per_node": 8}
    return Setup(model, **{**base, **kw}, compile_=True, float8=False, spec=load_spec(DEFAULT_GPU))


# ---------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize(
    ("text", "value"), [("2T", 2e12), ("500B", 5e11), ("1.5e12", 1.5e12), ("300m", 3e8), ("2e12", 2e12), ("7", 7.0)]
)
def test_token_counts_with_suffixes(text, value):
    assert TOKENS.convert(text, None, None) == value


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--tokens", "0", "positive"),
        ("--tokens", "-2T", "positive"),
        ("--tokens", "2X", "not a token count"),
        ("--tokens", "nan", "not a token count"),
        ("--tokens", "inf", "not a token count"),
        ("--tokens", "1e400", "positive, finite"),
        ("--days", "0", "above 0"),
        ("--days", "-3", "above 0"),
        ("--days", "a month", "not a number of days"),
        ("--days", "inf", "above 0 and finite"),
    ],
)
def test_bad_budget_refused_naming_the_option(option, value, says):
    args = {"--tokens": "2T", "--days": "30"} | {option: value}
    res = CliRunner().invoke(plan, ["--model", "8B", *[x for kv in args.items() for x in kv]])
    assert res.exit_code == 2, res.output
    assert f"'{option}'" in res.output and says in res.output


def test_gpus_or_the_budget_is_needed():
    res = CliRunner().invoke(plan, ["--model", "8B", "--tokens", "2T"])
    assert res.exit_code == 2 and "--tokens and --days" in res.output


# ---------------------------------------------------------------------------------- answers
def test_the_answer_is_plans_first_layout_and_the_smallest_count():
    """The layout found is `plan --gpus N`'s first one at that count; one node fewer does not
    finish in time; the days and GPU-hours follow from its predicted tokens/s."""
    s = setup_of("8B")
    a = search(s, TOKENS_2T, 30, best_at)
    n, c = a.found.gpus, a.found.best
    first = candidates("8B", n, 8192, 80.0, gpus_per_node=8, by_speed=True, gpu=s.spec)[0]
    assert (first.degrees, first.ac, first.tps) == (c.degrees, c.ac, c.tps)
    assert a.found.days == pytest.approx(TOKENS_2T / (c.tps * n) / 86400) and a.found.days <= 30
    below = [r for r in a.tried if r.gpus == n - 8]
    assert below and (below[0].days is None or below[0].days > 30)
    res = CliRunner().invoke(plan, ["--model", "8B", "--tokens", "2T", "--days", "30", "--json"])
    out = json.loads(res.output)
    assert res.exit_code == 0 and out["gpus"] == n and out["nodes"] == n // 8 and out["finishes"]
    assert out["gpu_hours"] == pytest.approx(out["predicted_days"] * 24 * n, rel=1e-3)
    assert "mean absolute error" in out["error_band"] and out["layout"] == c.layout()


@pytest.mark.parametrize(
    ("days", "budget", "shown"),
    [
        (30.04, 30, "30.04"),  # a miss never reads as the budget itself
        (29.96, 30, "30.0"),  # a hit may: 30.0 is within 30 days
        (29.954, 29.955, "29.95"),  # a hit never reads as over
        (30.00001, 30, "30.0001"),  # past four decimals a miss rounds up
        (67.6, 30, "67.6"),
    ],
)
def test_days_read_on_their_side_of_the_budget(days, budget, shown):
    assert days_text(days, budget) == shown
    for d in (budget * (1 + k / 1e5) for k in range(-400, 401)):
        assert (float(days_text(d, budget)) <= budget) == (d <= budget), d


def test_every_count_tried_prints_on_its_side_of_the_budget():
    """70B, 2T tokens, 30 days: each count's printed days are within the budget only when its
    predicted days are (1,712 GPUs' 30.05 days once printed as '30.0' above the 1,728 chosen)."""
    args = ["--model", "70B", "--tokens", "2T", "--days", "30"]
    searched = {
        r["gpus"]: r["days"] for r in json.loads(CliRunner().invoke(plan, [*args, "--json"]).output)["searched"]
    }
    res = CliRunner().invoke(plan, args)
    assert res.exit_code == 0, res.output
    printed = {
        int(m.group(1).replace(",", "")): float(m.group(2))
        for m in re.finditer(r"^ +([\d,]+) GPUs: .*, ([\d.]+) days$", res.output, flags=re.MULTILINE)
    }
    assert set(printed) == {g for g, d in searched.items() if d is not None}
    wrong = {g: (printed[g], searched[g]) for g in printed if (printed[g] <= 30) != (searched[g] <= 30)}
    assert not wrong, f"days printed on the wrong side of the budget: {wrong}"


def test_the_bound_is_never_beaten():
    """No count predicts faster than `fastest_tokens_per_gpu`: the bound skips only counts that fail."""
    for model, gpus in (("8B", 64), ("70B", 512), ("405B", 2048)):
        s = setup_of(model)
        c = best_at(s, gpus)
        assert c is not None and c.tps < fastest_tokens_per_gpu(s)


@pytest.mark.parametrize("model", ["8B", "70B"])
def test_more_days_never_need_more_gpus(model):
    s = setup_of(model)
    found = []
    for days in (5, 12, 30, 45, 90, 365):
        a = search(s, TOKENS_2T, days, best_at)
        found.append(a.found.gpus if a.found else MAX_GPUS + 1)
        assert a.found is None or a.found.gpus % 8 == 0
    assert found == sorted(found, reverse=True), found
    assert found[-1] < found[0]


def test_says_why_nothing_finishes():
    res = CliRunner().invoke(plan, ["--model", "405B", "--tokens", "2T", "--days", "5"])
    assert res.exit_code == 1 and "nothing finishes" in res.output
    assert "time: at 16,384 GPUs (the largest tried)" in res.output and "days" in res.output
    res = CliRunner().invoke(plan, ["--model", "405B", "--tokens", "2T", "--days", "30", "--gpu-mem", "0.3"])
    assert res.exit_code == 1 and "memory:" in res.output and "16 bytes per parameter" in res.output
    res = CliRunner().invoke(plan, ["--model", "405B", "--tokens", "2T", "--days", "0.5"])
    assert res.exit_code == 1 and "time: even with every matmul at the spec's fastest rate" in res.output


@pytest.mark.parametrize("model", ["8B", "70B", "405B"])
def test_answers_in_under_30_s(model):
    from recipes.plan import budget as plan_budget

    plan_budget._BEST.clear()  # no answer from an earlier test: the search from scratch
    t0 = time.perf_counter()
    res = CliRunner().invoke(plan, ["--model", model, "--tokens", "2T", "--days", "30", "--gpu", "h100_sxm_80gb"])
    took = time.perf_counter() - t0
    assert res.exit_code in (0, 1), res.output
    print(f"\nplan --model {model} --tokens 2T --days 30: {took:.1f} s")
    assert took < 30
