"""`python -m cupysparse info` prints every line a bug report needs, on any machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


KEYS = [
    "cupysparse",
    "python",
    "platform",
    "numpy",
    "backend",
    "gpu",
    "cupy",
    "cuda runtime",
    "cuda driver",
    "nvrtc",
    "cuda include dirs",
    "crt/mma.h",
    "kernel cache dir",
    "benchmark cache dir",
    "torch",
    "jax",
    "environment",
]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cupysparse", *args], capture_output=True, text=True, env=env, timeout=300
    )


def report(stdout: str) -> dict[str, str]:
    """Key -> first value line; continuation lines (indented) belong to the key above."""
    rows = [line.split(":", 1) for line in stdout.splitlines() if not line.startswith(" ")]
    return {key: value.strip() for key, value in rows}


def info(tmp_path) -> dict[str, str]:
    env = {**os.environ, "CUPYSPARSE_BENCHMARK_CACHE_DIR": str(tmp_path / "bench")}
    result = run_cli("info", env=env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    rows = report(result.stdout)
    assert list(rows) == KEYS, result.stdout
    assert rows["benchmark cache dir"] == str(tmp_path / "bench")
    return rows


def test_info_prints_every_key(tmp_path):
    rows = info(tmp_path)
    assert rows["backend"] in {"cuda", "numpy (no GPU)", "numpy (CuPy not installed)"}
    assert rows["numpy"][0].isdigit()


@pytest.mark.gpu
@pytest.mark.gpu
def test_info_on_gpu_names_the_device(tmp_path):
    rows = info(tmp_path)
    assert rows["backend"] == "cuda"
    assert "compute capability" in rows["gpu"]
    assert not rows["cuda driver"].startswith("not found")


@pytest.mark.parametrize("args", [[], ["no-such-command"]])
def test_missing_or_unknown_command_exits_2(args):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "usage: python -m cupysparse" in result.stderr
    assert "info" in result.stderr
