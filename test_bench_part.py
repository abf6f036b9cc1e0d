"""Smoke test of the benchmark (issue 7): it runs end to end at a tiny size and reports sane numbers.

No timing assertions: timings depend on the machine and its load. Only that every timing is a
finite positive number, every kernel agrees with its float64 reference, and the result is JSON.
"""

import json
import math

import run as run_cli


def test_bench_tiny_runs_and_reports_finite_numbers():
    lines = []
    result = run_cli.bench(device="cpu", size="tiny", print_fn=lines.append)
    json.dumps(result)  # the whole result must be JSON-serialisable
    assert result["env"]["device"] == "cpu" and lines

    assert {row["kernel"] for row in result["scan"]} >= {"sequential", "scan", "parallel", "loop"}
    for row in result["scan"]:
        for key in ("fwd_ms", "fwdbwd_ms", "fwd_speedup", "fwdbwd_speedup"):
            assert math.isfinite(row[key]) and row[key] > 0, (row, key)
        assert row["max_abs_err"] <= 1e-5, row      # float32 vs float64 loop
        assert row["grad_rel_err"] <= 1e-4, row

    for row in result["selective_scan"]:         # Mamba's fused scan, if models.py has one
        assert math.isfinite(row["fwdbwd_speedup"]) and row["fwdbwd_ms"] > 0, row
        assert row["max_abs_err"] <= 1e-4 and row["grad_rel_err"] <= 1e-4, row

    assert result["conv"]
    for row in result["conv"]:
        assert math.isfinite(row["fft_speedup"]) and row["direct_ms"] > 0 and row["fft_ms"] > 0, row
        assert row["fft_max_abs_err"] <= 1e-5, row

    # Training and patching rows exist for the archs that build; each has a positive rate.
    assert result["train"], result["notes"]
    for row in result["train"]:
        assert row["fast_steps_s"] > 0 and row["reference_steps_s"] > 0 and math.isfinite(row["speedup"])
    for row in result["mechanism"]:
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0 and row["cells"] > 0
