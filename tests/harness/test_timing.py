"""dp-bench's one timed-steps helper (``dp_bench.timing``): warm-up steps untimed, arms interleaved in ABBA order,
every timed step reported after it is timed."""

from __future__ import annotations

import time

from dp_bench.timing import median_time, spread, timed_steps


def test_warm_up_first_then_arms_in_abba_order() -> None:
    calls: list[tuple[int, object]] = []
    events: list[str] = []
    times = timed_steps(
        lambda i, arm: calls.append((i, arm)),
        3,
        arms=("on", "off"),
        warmup=2,
        on_start=lambda: events.append("start"),
        after=lambda i, arm, s: events.append(f"{i}{arm}"),
    )
    assert calls == [(0, "on"), (1, "off"), (2, "on"), (3, "off"), (4, "off"), (5, "on"), (6, "on"), (7, "off")]
    assert events == ["start", "2on", "3off", "4off", "5on", "6on", "7off"]  # warm-up steps are not timed
    assert {arm: len(ts) for arm, ts in times.items()} == {"on": 3, "off": 3}


def test_one_arm_times_each_call() -> None:
    times = timed_steps(lambda i, arm: time.sleep(0.01 * (i + 1)), 3)[None]
    assert len(times) == 3 and times[0] < times[2] and 0.009 < times[0] < 0.5
    assert 0.005 < median_time(lambda: time.sleep(0.01), 3) < 0.5
    assert spread([1.0, 2.0, 3.0]) == {"median": 2.0, "q1": 1.5, "q3": 2.5, "min": 1.0, "max": 3.0, "n": 3}
