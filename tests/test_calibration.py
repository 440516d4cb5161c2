"""A calibration measured while other processes shared the machine (decode/costs.py, "settled"):
kept for the process that measured it, stored as unsettled, measured again at the next start and
merged point by point, at most MEASURES_MAX times."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from drafter_fixtures import target, workspace

from mlx_dspark import machine
from mlx_dspark.decode import costs as cost_curves
from mlx_dspark.decode.costs import Costs


def test_a_merge_keeps_each_point_at_the_faster_measurement():
    old = Costs([1, 2, 4], [0.010, 0.030, 0.020], t_draft=0.004, t_plain=0.011, settled=False, measured_s=3.0)
    new = Costs([1, 2, 4, 8], [0.012, 0.012, 0.014, 0.018], t_draft=0.005, t_plain=0.009, measured_s=2.5)
    m = cost_curves.merged(old, new)
    assert m.widths == [1, 2, 4, 8] and m.t_verify == [0.010, 0.012, 0.014, 0.018]
    assert (m.t_draft, m.t_plain, m.measures, m.settled, m.measured_s) == (0.004, 0.009, 2, True, 5.5)
    assert cost_curves.merged(m, Costs([1], [0.02], settled=False)).settled is False
    assert cost_curves.merged(Costs([1], [0.02]), Costs([1], [0.01], t_draft=0.003)).t_draft == 0.003


def test_others_share_sees_a_process_that_keeps_a_cpu_busy():
    """machine.OthersShare: a child spinning on a CPU while this process sleeps takes a clear share
    of the machine (one CPU of however many there are, on top of whatever else runs)."""
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)  # the child is running
        meter = machine.OthersShare()
        time.sleep(1.5)
        share = meter.share()
    finally:
        spin.kill()
        spin.wait()
    assert share is not None and share >= 0.5 / machine.os.cpu_count()


def test_others_share_falls_back_to_the_load_average_without_proc_stat(monkeypatch):
    """macOS has no /proc/stat: the 1-minute load average stands in, less this process's own share."""
    monkeypatch.setattr(machine, "_busy_cpu_seconds", lambda: None)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (3.0, 1.0, 1.0))
    meter = machine.OthersShare()
    time.sleep(0.2)  # sleeping: this process's own share is ~0
    assert meter.share() == pytest.approx(0.75, abs=0.05)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert meter.share() == 0.0


def test_an_unsettled_calibration_is_measured_again_until_it_settles_or_runs_out(calibration_dir, monkeypatch):
    """A busy machine (other processes took 90% of it): the curve serves this process, is stored as
    unsettled, and the next start measures again and keeps each point at the faster of the two;
    after MEASURES_MAX measurements the stored curve is used as it is. A quiet start settles it."""
    busy = {"share": 0.9}
    monkeypatch.setattr(machine.OthersShare, "share", lambda self: busy["share"])
    ws = workspace()
    tgt, _ = target(ws["target_qwen3"])
    first = cost_curves.costs_for(tgt)
    assert first.origin == "measured" and not first.settled and first.others_share == 0.9
    assert "unsettled after 1 measurement(s): measured again at the next start" in first.summary()
    (file,) = calibration_dir.glob("*.json")
    assert json.loads(file.read_text())["value"]["settled"] is False
    seen = [first]
    for n in range(2, cost_curves.MEASURES_MAX + 1):
        cost_curves._memo.clear()  # a new process
        c = cost_curves.costs_for(tgt)
        assert c.origin == "measured" and c.measures == n and not c.settled
        prev = dict(zip(seen[-1].widths, seen[-1].t_verify))
        assert all(t <= prev.get(w, t) for w, t in zip(c.widths, c.t_verify))  # never slower than before
        assert c.t_plain <= seen[-1].t_plain
        seen.append(c)
    cost_curves._memo.clear()
    kept = cost_curves.costs_for(tgt)  # measured MEASURES_MAX times: used as stored
    assert kept.origin == "disk" and kept.measures == cost_curves.MEASURES_MAX and kept.t_verify == seen[-1].t_verify
    assert "kept" in kept.summary()

    file.unlink()  # a fresh key's first start while busy, then a quiet start
    cost_curves._memo.clear()
    assert not cost_curves.costs_for(tgt).settled
    busy["share"] = 0.0
    cost_curves._memo.clear()
    quiet = cost_curves.costs_for(tgt)
    assert quiet.settled and quiet.measures == 2 and quiet.origin == "measured"
    cost_curves._memo.clear()
    assert cost_curves.costs_for(tgt).origin == "disk"  # settled: not measured again
