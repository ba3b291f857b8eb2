"""The evaluation's capacity reading (loadtest.eval_report.capacity): the highest offered
rate at which 90% of all requests meet both SLOs, read off the load sweep."""

from kvmesh.loadtest.eval_report import capacity


def _run(config: str, load_x: float, rate: float, attained: float) -> dict:
    summary = {
        "goodput_rps": rate * attained,
        "ttft_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0},
        "tbt_ms": {"p50": 1.0, "p99": 1.0},
        "slo_attainment": attained,
        "slo_attainment_accepted": 1.0,
        "acceptance_rate": 1.0,
        "cache_hit_ratio": 0.0,
        "served": 10,
        "requests": 10,
        "rejected": 0,
        "failed": 0,
    }
    return {
        "config": config,
        "workload": "w",
        "load_x": load_x,
        "rate_rps": rate,
        "summary": summary,
    }


def test_capacity_interpolates_between_the_points_that_straddle_90_percent() -> None:
    ev = {
        "runs": [
            _run("a", 0.5, 1.0, 1.0),
            _run("a", 1.0, 2.0, 0.95),
            _run("a", 2.0, 4.0, 0.65),
            _run("a", 3.0, 6.0, 0.2),
        ]
    }
    c = capacity(ev, "w", "a")
    assert c is not None and c["bracketed"]
    # 0.95 -> 0.65 crosses 0.9 a sixth of the way from 1x (2 rps) to 2x (4 rps)
    assert abs(c["load_x"] - (1 + 1 / 6)) < 1e-9
    assert abs(c["rps"] - (2 + 2 / 6)) < 1e-9


def test_capacity_is_a_lower_bound_when_every_point_attains_it() -> None:
    ev = {"runs": [_run("a", 1.0, 2.0, 1.0), _run("a", 3.0, 6.0, 0.95)]}
    c = capacity(ev, "w", "a")
    assert c == {"rps": 6.0, "load_x": 3.0, "bracketed": False}


def test_capacity_uses_the_median_of_repeats_and_is_none_below_target_everywhere() -> None:
    runs = [_run("a", 1.0, 2.0, x) for x in (0.5, 0.95, 0.97)] + [_run("a", 2.0, 4.0, 0.1)]
    c = capacity({"runs": runs}, "w", "a")
    assert c is not None and c["bracketed"]  # median 0.95 at 1x, not the 0.5 outlier
    assert capacity({"runs": [_run("b", 1.0, 2.0, 0.8)]}, "w", "b") is None
