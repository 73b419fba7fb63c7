"""The benchmarks run end to end on the CPU and report what they built."""

import csv

from cupysparse.scripts import benchmark_conv, benchmark_kernel_map


def test_kernel_map_benchmark_writes_its_table(tmp_path, capsys):
    output = tmp_path / "maps.csv"
    status = benchmark_kernel_map.main(
        ["--device", "cpu", "--num-voxels", "2000", "--network-voxels", "1500", "--repeats", "1", "--warmup", "0",
         "--csv", str(output)]
    )
    assert status == 0
    with open(output) as handle:
        rows = list(csv.DictReader(handle))
    stages = {(row["case"], row["stage"]) for row in rows}
    assert ("subm 3^3", "map + mask + order") in stages and ("strided 2^3/2", "downsample (unique)") in stages
    network = [row for row in rows if row["case"] == "MinkUNet18"]
    assert [row["stage"] for row in network] == ["inference maps", "training maps"]
    # Two scenes of about 1500 voxels each (the scenes hit their count within 5%).
    assert all(2 * 1425 <= int(row["num_voxels"]) <= 2 * 1575 for row in network)
    assert all(float(row["cupysparse_ms"]) > 0 and row["spconv_ms"] == "" for row in rows)
    assert "CPU" in capsys.readouterr().out


def test_conv_benchmark_times_the_cpu_algorithms(tmp_path, capsys):
    output = tmp_path / "conv.csv"
    status = benchmark_conv.main(
        ["--device", "cpu", "--num-voxels", "3000", "--channels", "8,16", "--dtype", "fp32", "--repeats", "1",
         "--warmup", "0", "--csv", str(output)]
    )
    assert status == 0
    with open(output) as handle:
        rows = list(csv.DictReader(handle))
    phases = ("forward", "dgrad", "wgrad", "forward+backward")
    assert [(row["channels"], row["phase"], row["algorithm"]) for row in rows] == [
        (c, phase, "explicit_gemm") for c in ("8", "16") for phase in phases
    ]
    assert all(float(row["ms"]) > 0 and float(row["tflops"]) > 0 and int(row["pairs"]) > 3000 for row in rows)
    for first in (0, 4):
        forward, _, _, both = (float(row["ms"]) for row in rows[first : first + 4])
        assert both >= forward
    assert "best explicit_gemm" in capsys.readouterr().out
