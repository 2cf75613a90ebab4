"""A short soak under faults (tests/load/soak.py): mixed traffic against ``dflash-serve``, with
a slowloris client, 500 connections at once, ``kill -9`` during a disk-tier write, the disk
tier's folder read-only then full (when a tmpfs can be mounted here) and a restart. No 5xx,
every greedy answer equal to its solo run, each fault handled, no memory growth that the
caches do not explain. The long run is ``tests/load/soak.py --minutes 60``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "load"))
from soak import soak

# One minute of traffic (the CI run is 3: shortened to keep the suite's time; with the
# model starts and solo runs about 2 minutes in all), memory sampled every 3 s.
MINUTES = 1.0


@pytest.mark.system
def test_a_short_soak_under_faults(tmp_path: Path) -> None:
    run = soak(MINUTES, tmp_path, 16, read_timeout=5.0, faults=True, warmup_s=10, sample_s=3)
    report = asyncio.run(run)
    assert report["ok"], report["failures"]
    requests, faults = report["requests"], report["faults"]
    assert not any(status.startswith("5") for status in requests["by_status"]), requests
    assert requests["greedy_checked"] >= 10 and not requests["greedy_mismatch"]
    assert faults["slowloris"]["status"] == "408"
    assert faults["500 connections"]["answers"] == {"200": 500}
    assert faults["kill -9 mid-write"]["partial_after_start"] == 0
    if report["disk"].startswith("tmpfs"):  # mounting needs root
        assert faults["read-only folder"]["warnings"] == 1
        assert faults["full folder"]["warnings"] == 1
    assert report["health_at_end"]["status"] == "ready"
