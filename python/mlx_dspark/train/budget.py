"""`distill --train-seconds`: how many steps fit in a time budget, measured as the run goes.

The step time is first measured over steps 5-25 (the first kernels are compiled by then), which fixes
the schedule early. Batches of new shapes keep compiling kernels for a while after that (MLX's CUDA
backend JIT-compiles each new shape), so that first figure runs slow: on an H100 it said 119 ms/step
against the 92 ms the run then took, and 25% of the budget went unused. So the fit is made again
after each tenth of the run, each time over the steps since the last fit, until half the run is
done. The end of the cosine schedule moves while its learning rate is still high, so the curve
barely changes.
"""

from __future__ import annotations

FIRST = (5, 25)  # steps after the start between which the first fit measures
REFITS = 5  # then refits, one per tenth of the fitted run (at least REFIT_MIN steps), up to half of it
REFIT_MIN = 50


class StepBudget:
    """Call `after(step, now)` after every step; it returns a new total step count when a fit moves
    it (never above `cap`, the steps asked for), else None."""

    def __init__(self, seconds: float, start_step: int, cap: int, t_start: float):
        self.seconds, self.start, self.cap, self.t_start = float(seconds), start_step, cap, t_start
        self.mark: tuple[int, float] | None = None  # (step, time) the next fit measures from
        self.next_fit = start_step + FIRST[1]
        self.refits_left = REFITS
        self.ms_per_step: float | None = None

    def after(self, step: int, now: float) -> int | None:
        if step == self.start + FIRST[0]:
            self.mark = (step, now)
            return None
        if self.mark is None or step != self.next_fit:
            return None
        dt = (now - self.mark[1]) / (step - self.mark[0])
        self.ms_per_step = dt * 1000
        total = min(self.cap, step + max(int((self.seconds - (now - self.t_start)) / dt), 0))
        self.mark = (step, now)
        self.next_fit = step + max(REFIT_MIN, (total - self.start) // 10)
        if step > self.start + FIRST[1]:
            self.refits_left -= 1
        if self.refits_left < 0 or self.next_fit > self.start + (total - self.start) // 2:
            self.next_fit = -1  # no more fits
        return total
