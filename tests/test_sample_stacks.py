"""``benchmarks/sample_stacks.py`` runs a script as ``python script.py args``
would and says where its main thread spent the time."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--interval-ms", "0", "--", "work.py"], "expected --interval-ms > 0 and --top >= 1, got 0.0 and 300"),
        (["--", "missing.py"], "expected a Python script to run, got 'missing.py' \\(no such file\\)"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    (tmp_path / "work.py").write_text("open('ran', 'w').close()")
    out = tmp_path / "sampled.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=tmp_path,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and re.search(message, run.stderr), run.stderr
    assert not out.exists() and not (tmp_path / "ran").exists()
