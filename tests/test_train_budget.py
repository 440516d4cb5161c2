"""`distill --train-seconds`: the step count is fitted twice, so a slow start (kernels compiling for
new batch shapes) does not leave the budget unused (train/budget.py). A fake clock drives it."""

from __future__ import annotations

from mlx_dspark.train.budget import StepBudget


def run(budget: float, cap: int, step_time, start: int = 0):
    """Simulate a training loop as trainer.train drives StepBudget: (steps run, seconds used, fits)."""
    fit = StepBudget(budget, start, cap, t_start=0.0)
    total, now, step, fits = cap, 0.0, start, []
    while step < total:
        now += step_time(step)
        step += 1
        new = fit.after(step, now)
        if new is not None:
            fits.append((step, new))
            total = new
    return step, now, fits


def test_a_slow_start_is_refitted_and_the_budget_is_used():
    # Steps cost 2 s while kernels compile (the first 60), then 1 s.
    steps, used, fits = run(1000.0, 20000, lambda s: 2.0 if s < 60 else 1.0)
    (s1, t1), (s_last, t_last) = fits[0], fits[-1]
    assert s1 == 25 and t1 == 25 + int((1000 - 50) / 2.0)  # the first fit believes the slow start
    assert t_last > t1 and steps == t_last  # later fits see the real pace and extend the run
    assert 2 <= len(fits) <= 6 and s_last <= t_last // 2  # no fit after half the run
    assert 0.97 * 1000 <= used <= 1000 + 2.0
    # The first fit alone would have stopped at about half the budget.
    assert t1 < 0.6 * t_last


def test_a_steady_pace_keeps_the_first_fit_and_never_overruns():
    steps, used, fits = run(300.0, 20000, lambda s: 0.125)
    assert fits[0] == (25, 2400)
    assert all(t == 2400 for _, t in fits)  # the second fit agrees with the first
    assert steps == 2400 and used <= 300.0


def test_the_steps_asked_for_cap_the_fit():
    steps, used, fits = run(1000.0, 400, lambda s: 0.1)
    assert steps == 400 and all(t <= 400 for _, t in fits)


def test_a_slowdown_shortens_the_run_inside_the_budget():
    # Steps 5-25 are fast, then the pace halves (e.g. longer answers): the second fit cuts back.
    steps, used, fits = run(200.0, 20000, lambda s: 0.1 if s < 25 else 0.2)
    assert fits[-1][1] < fits[0][1] and used <= 200.0 + 0.2


def test_a_resumed_run_counts_from_its_first_step():
    steps, used, fits = run(100.0, 20000, lambda s: 0.5, start=1000)
    assert fits[0] == (1025, 1025 + int((100 - 12.5) / 0.5))
    assert used <= 100.0 + 0.5
