"""CPU tests of kimi.benchmarks.smi's nvidia-smi sample parsing and summary (GpuSampler's pure parts; the sampler
itself runs where nvidia-smi does, in the GPU benchmarks)."""

import datetime

from kimi.benchmarks.smi import SW_POWER_CAP, parse_smi_sample, summarize_samples


def test_a_sample_line_parses_to_local_epoch_seconds():
    s = parse_smi_sample("2026/11/30 15:26:47.123, 1755, 694.25, 700.00, 0x0000000000000004\n")
    want = datetime.datetime(2026, 11, 30, 15, 26, 47, 123000).timestamp()
    assert s == {"t": want, "sm_MHz": 1755.0, "power_W": 694.25, "limit_W": 700.0, "reasons": SW_POWER_CAP}


def test_lines_that_are_not_samples_are_skipped():
    for line in [
        "",
        "timestamp, clocks.sm [MHz], power.draw [W]",
        "2026/11/30 15:26:47.123, [N/A], 694.25, 700.00, 0x0",
        "Failed to initialize NVML: Unknown Error",
        "2026/11/30 15:26:47.123, 1755, 694.25, 700.00",
    ]:
        assert parse_smi_sample(line) is None, line


def test_summary_gives_clock_percentiles_and_the_power_capped_share():
    samples = [
        {
            "t": i,
            "sm_MHz": 1000.0 + 100 * i,
            "power_W": 690.0 + i,
            "limit_W": 700.0,
            "reasons": SW_POWER_CAP if i % 2 else 0,
        }
        for i in range(10)
    ]
    out = summarize_samples(samples)
    assert out["samples"] == 10 and out["limit_W"] == 700.0
    assert out["sm_clock_MHz"] == {"median": 1450.0, "p10": 1100.0, "p90": 1900.0, "min": 1000.0}
    assert out["power_W_median"] == 694.5 and out["power_capped_fraction"] == 0.5
    assert summarize_samples([]) is None
