"""The scripts run as files from a checkout (`python scripts/X.py …`, as the tuner issue documents them),
each in its own process from the repository root, the cache scripts with their documented flags."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS_WITH_MAIN = sorted(
    path.name for path in (REPOSITORY / "scripts").glob("*.py") if re.search(r"^def main\(", path.read_text(), re.MULTILINE)
)
TINY_GRID = ["--device", "cpu", "--num-voxels", "2000", "3K", "--channels", "4,8", "--kernel-sizes", "3",
             "--dtypes", "float32", "--algo-mode", "all", "--batch-size", "1"]


@pytest.fixture
def environment(tmp_path):
    """This process's environment with the tuning cache in a temporary directory."""
    return {**os.environ, "CUPYSPARSE_BENCHMARK_CACHE_DIR": str(tmp_path / "cache")}


def run_script(name: str, *argv: str, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"scripts/{name}", *argv], cwd=REPOSITORY, env=environment,
                          capture_output=True, text=True, timeout=120, check=False)


def succeeds(name: str, *argv: str, environment: dict) -> str:
    """The standard output of `python scripts/NAME ARGV…`, which must exit 0."""
    finished = run_script(name, *argv, environment=environment)
    assert finished.returncode == 0, f"scripts/{name} {' '.join(argv)}:\n{finished.stderr}"
    return finished.stdout


def test_the_scripts_with_a_main_are_found():
    assert {"populate_benchmark_cache.py", "inspect_benchmark_cache.py", "analyze_autotune_cache.py",
            "cli.py", "info.py"} <= set(SCRIPTS_WITH_MAIN)
    assert "benchmarking.py" not in SCRIPTS_WITH_MAIN  # helpers without a command are not run


@pytest.mark.parametrize("name", SCRIPTS_WITH_MAIN)
def test_every_script_answers_help_when_run_as_a_file(name, environment):
    assert succeeds(name, "--help", environment=environment).startswith("usage: ")


def test_the_documented_cache_script_invocations(environment, tmp_path):
    populate, inspect, analyze = "populate_benchmark_cache.py", "inspect_benchmark_cache.py", "analyze_autotune_cache.py"
    assert succeeds(populate, "--preset", "default", "--dry-run", environment=environment).splitlines()[-1] \
        == "364 configurations"
    listed = succeeds(populate, "--preset", "quick", "--dry-run", "--dtypes", "float16", "bfloat16", "float32",
                      environment=environment)
    assert listed.splitlines()[-1] == "18 configurations"  # 2 sizes x 3 channel pairs x 3 dtypes

    forward = succeeds(populate, *TINY_GRID, "--forward-only", environment=environment)
    assert "done 2, skipped 0 (already cached), failed 0" in forward and "backward:" not in forward
    backward = succeeds(populate, *TINY_GRID, "--resume", "--backward-only", environment=environment)
    assert "done 2, skipped 0 (already cached), failed 0" in backward and "forward:" not in backward
    resumed = succeeds(populate, *TINY_GRID, "--resume", environment=environment)
    assert "done 0, skipped 2 (already cached), failed 0" in resumed

    summary = succeeds(inspect, environment=environment)
    assert "NAMESPACE TREE\n" + "=" * 60 + "\nTotal namespaces: " in summary
    assert "- sparse_conv_forward: 2 entry(ies)\n" in summary and "- sparse_conv_backward: 2 entry(ies)\n" in summary
    namespace = succeeds(inspect, "namespace=sparse_conv_forward", environment=environment)
    assert namespace.startswith("Namespace: sparse_conv_forward (2 configurations)\n")
    assert re.search(r'^    \["explicit_gemm", \{\}, \d+\.\d{3}\]$', namespace, re.MULTILINE)
    for limit in (["--best-only"], ["--top-k", "1"]):
        assert succeeds(inspect, "namespace=sparse_conv_forward", *limit, environment=environment) == namespace
    assert "Namespace: sparse_conv_backward (2 of 2 configurations match" in succeeds(
        inspect, "explicit", environment=environment)
    searched = succeeds(inspect, "namespace=sparse_conv_forward", "float32", "in_channels", environment=environment)
    assert searched.startswith('Namespace: sparse_conv_forward (2 of 2 configurations match "float32 in_channels")')

    report = tmp_path / "analysis.md"
    assert succeeds(analyze, "--markdown", "--output", str(report), environment=environment).startswith(
        f"Wrote the analysis to {report}")
    assert "| explicit_gemm | 2 | 100.0% | 100.0% | 2 |" in report.read_text()
