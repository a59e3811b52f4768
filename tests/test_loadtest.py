"""scripts/loadtest.py, briefly, against a real server with a queue small enough to overflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_HOME
from tests.serving import kiln_server

SCRIPT = Path(__file__).parents[1] / "scripts" / "loadtest.py"


@pytest.mark.slow
def test_loadtest_passes_with_disconnects_and_a_full_queue(smollm2_path, tmp_path):
    out = tmp_path / "result.json"
    with kiln_server(TEST_HOME, "smollm2:135m", "--parallel", "4", "--max-queue", "2", "--ctx-len", "512") as server:
        done = subprocess.run([sys.executable, str(SCRIPT), "--url", server.url, "--clients", "8", "--duration", "15",
                               "--max-tokens", "32", "--disconnect", "0.3", "--ratio-clients", "4",
                               "--ratio-seconds", "5", "--burst-clients", "6", "--json", str(out)],
                              capture_output=True, text=True, timeout=240)
        assert server.metric("kiln_requests_running") == 0
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    stress = result["stress"]
    assert stress["completed"] > 0 and stress["disconnected"] > 0
    assert stress["queue_full"] > 0  # 8 clients against 4 slots and 2 queue places
    assert set(stress["statuses"]) <= {"200", "503"}
    assert result["throughput"]["one"]["tok_per_s"] > 0 and result["throughput"]["ratio"] > 0
    # 6 requests sharing a system prompt that one slot held, against 4 slots: the 3 that found no free slot
    # holding it copied it from a running request's slot, the 2 that queued found it in a freed slot
    assert len(result["burst"]) == 2
    for burst in result["burst"]:
        assert burst["requests"] == 6 and min(burst["cached_tokens"]) >= 200, burst


def test_loadtest_refuses_other_hosts():
    done = subprocess.run([sys.executable, str(SCRIPT), "--url", "http://example.com:11500"], capture_output=True, text=True)
    assert done.returncode != 0 and "loopback" in done.stderr
