"""The cold-start benchmark end to end on the CPU, with both frameworks: what it reports adds up."""

import re

import pytest
from cupysparse.scripts import benchmark_cold_start


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_cold_start_reports_the_first_and_the_steady_forward(framework, tmp_path, monkeypatch, capsys):
    if framework == "torch":
        pytest.importorskip("torch")
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path))
    assert benchmark_cold_start.main(["--device", "cpu", "--framework", framework, "--num-voxels", "2000",
                                      "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert f"MinkUNet18 ({framework}), indoor scene" in out and "float32" in out
    first = float(re.search(r"first forward\s+([\d.]+) ms", out).group(1))
    steady = float(re.search(r"steady forward\s+([\d.]+) ms", out).group(1))
    ratio = float(re.search(r"ratio\s+([\d.]+)x", out).group(1))
    since_construction = float(re.search(r"([\d.]+) s from the network's construction", out).group(1))
    assert first > 0 and steady > 0
    assert since_construction + 0.05 >= first / 1e3  # printed to a tenth of a second
    assert ratio == pytest.approx(first / steady, rel=0.02, abs=0.01)
    assert "0 compiled by NVRTC" in out and "0 problems tuned" in out  # the NumPy path compiles and tunes nothing
