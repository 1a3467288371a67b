"""``benchmarks/sample_stacks.py`` runs a script as ``python script.py args``
would and says where its main thread spent the time."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sample_stacks.py"

BUSY = """
import sys, time

def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

def idle(seconds):
    time.sleep(seconds)

busy(0.6)
idle(0.2)
print(" ".join(sys.argv[1:]))
"""


def test_the_sampled_seconds_follow_where_the_script_spent_them(tmp_path):
    script, out = tmp_path / "work.py", tmp_path / "result" / "sampled.json"
    script.write_text(BUSY)
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--", str(script), "--flag", "1"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.strip() == "--flag 1"  # the script got its own arguments
    result = json.loads(out.read_text())
    inclusive = {row["function"].rsplit(":", 1)[1]: row["seconds"] for row in result["inclusive"]}
    assert 0.4 < inclusive["busy"] < 0.8, inclusive
    assert 0.1 < inclusive["idle"] < 0.4, inclusive
    assert result["samples"] > 20 and any(stack[0].endswith(":busy") for _, stack in result["stacks"])
