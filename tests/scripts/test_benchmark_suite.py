"""The benchmark suite on the CPU: the harness's files, statuses and numbers; the analysis's plots,
tables and results page; the crossover rule on a hand-made table."""

import csv
import itertools
import json
import math
import os
import signal
import sys

import numpy as np
import pytest

from cupysparse.algorithms import ConvProblem, get_algorithm
from cupysparse.algorithms.explicit_gemm import ExplicitGemm
from cupysparse.cuda.compile import nvrtc_knows
from cupysparse.cuda.dtypes import as_feature_dtype
from cupysparse.data.scenes import make_scene
from cupysparse.scripts import analyze_benchmarks as analysis
from cupysparse.scripts import benchmark_memory_analysis as harness
from cupysparse.scripts import memory_analysis_backends
from cupysparse.scripts.benchmarking import interleaved_samples_ms
from cupysparse.geometry.sparse_tensor import SparseTensor

GRID = ["--device", "cpu", "--num-voxels", "1000,2000", "--channels", "8,16", "16,16", "--kernel-sizes", "3",
        "--strides", "1", "2", "--dtypes", "fp32", "bf16", "--repeats", "2", "--iterations", "2", "--warmup", "1",
        "--backends", "explicit_gemm,auto,wmma_implicit_gemm,spconv,torch"]
GRID_SIZE = 2 * 2 * 2 * 2  # voxel counts x channel pairs x strides x dtypes
RUNNABLE_ON_CPU = ("explicit_gemm", "auto", "torch")


def read_csv(path):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One harness run on the tiny grid, then the analysis of it with a results page."""
    root = tmp_path_factory.mktemp("suite")
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's worker threads spin for whole time slices on shared CPU-test machines
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(root / "tuning"))
            assert harness.main([*GRID, "--output-dir", str(root / "results")]) == 0
    finally:
        torch.set_num_threads(threads)
    analysis_argv = ["--input", str(root / "results" / "benchmark_full.csv"), "--output-dir", str(root / "plots"),
                     "--baseline", "explicit_gemm", "--markdown", str(root / "docs" / "benchmarks.md")]
    assert analysis.main(analysis_argv) == 0
    return root, analysis_argv


def full_rows(root):
    return read_csv(root / "results" / "benchmark_full.csv")[1]


def number(text):
    return None if text == "" else float(text)


def brute_force_pairs(coordinates, kernel_size: int, stride: int) -> int:
    """Pairs of a convolution by definition: output voxels floor(in / stride), a pair per output
    voxel q and offset o with an input at q·stride + o, o = d - (k - 1) // 2 along each axis."""
    inputs = {tuple(row) for row in coordinates.tolist()}
    outputs = {(row[0], *(value // stride for value in row[1:])) for row in coordinates.tolist()}
    reach = range(-((kernel_size - 1) // 2), kernel_size - (kernel_size - 1) // 2)
    return sum(
        (out[0], *(q * stride + o for q, o in zip(out[1:], offset))) in inputs
        for out in outputs for offset in itertools.product(reach, repeat=3)
    )


def test_the_harness_writes_its_three_files_with_the_documented_columns(suite):
    root, _ = suite
    columns, rows = read_csv(root / "results" / "benchmark_full.csv")
    assert tuple(columns) == harness.FULL_COLUMNS
    assert len(rows) == GRID_SIZE * 5 * len(harness.PHASES)
    assert {row["status"] for row in rows} <= set(harness.STATUSES)
    keys = {tuple(row[column] for column in harness.KEY_COLUMNS) for row in rows}
    assert len(keys) == GRID_SIZE
    breakdown_columns, breakdown = read_csv(root / "results" / "memory_breakdown.csv")
    assert tuple(breakdown_columns) == harness.BREAKDOWN_COLUMNS
    assert len(breakdown) == GRID_SIZE * len(RUNNABLE_ON_CPU) * len(harness.PHASES)
    for row in breakdown:
        parts = sum(float(row[f"{part}_mb"]) for part in harness.BREAKDOWN_PARTS)
        assert float(row["estimated_mb"]) == pytest.approx(parts, abs=3e-3)
        if row["backend"] != "torch":  # torch's CPU memory is not traced
            assert 0.3 < float(row["peak_memory_mb"]) / float(row["estimated_mb"]) < 3
    with open(root / "results" / "heatmap_data.json") as handle:
        heatmaps = json.load(handle)
    metadata = heatmaps["metadata"]
    assert metadata["device"] == rows[0]["device"] == "CPU (NumPy)"
    assert metadata["command"].startswith("cupysparse-benchmark-memory-analysis --device cpu")
    assert metadata["versions"]["numpy"] == np.__version__
    cell = next(entry for entry in heatmaps["heatmaps"]
                if (entry["backend"], entry["phase"], entry["dtype"], entry["stride"]) == ("auto", "wgrad", "fp32", 2))
    assert cell["num_voxels"] == [1000, 2000] and cell["channels"] == ["8,16", "16,16"]
    expected = next(row for row in rows if (row["backend"], row["phase"], row["dtype"], row["stride"],
                                            row["num_voxels"], row["in_channels"]) == ("auto", "wgrad", "fp32", "2",
                                                                                       "2000", "8"))
    assert cell["status"][1][0] == "ok" and cell["median_ms"][1][0] == float(expected["median_ms"])


def test_pairs_times_and_throughput_are_consistent(suite):
    root, _ = suite
    rows = [row for row in full_rows(root) if row["status"] == "ok"]
    assert {row["backend"] for row in rows} == set(RUNNABLE_ON_CPU)
    expected_pairs = {}
    for count, stride in itertools.product((1000, 2000), (1, 2)):
        voxels = make_scene("indoor", count, seed=0).voxel_coordinates()[:count]
        coordinates = np.concatenate([np.zeros((len(voxels), 1), np.int32), voxels], axis=1)
        expected_pairs[(count, stride)] = (len(voxels), brute_force_pairs(coordinates, 3, stride))
    for row in rows:
        num_in, pairs = expected_pairs[(int(row["num_voxels"]), int(row["stride"]))]
        assert (int(row["num_in"]), int(row["pairs"])) == (num_in, pairs)
        median, q25, q75 = (float(row[name]) for name in ("median_ms", "q25_ms", "q75_ms"))
        assert 0 < q25 <= median <= q75
        assert (int(row["samples"]), int(row["iterations"])) == (2, 2)
        work = harness.GEMMS_PER_PHASE[row["phase"]] * 2 * pairs * int(row["in_channels"]) * int(row["out_channels"])
        assert float(row["tflops"]) == pytest.approx(work / median / 1e9, rel=1e-3)
        assert float(row["kernel_map_ms"]) > 0 and float(row["first_call_ms"]) > 0
        if row["backend"] == "torch":
            assert row["peak_memory_mb"] == "" and "not traced" in row["memory_source"]
        else:
            resident, call_peak = float(row["resident_mb"]), float(row["call_peak_mb"])
            assert float(row["peak_memory_mb"]) == pytest.approx(resident + call_peak, abs=2e-3)
            assert call_peak > 0 and row["memory_source"].startswith("tracemalloc")
            assert row["dispatched"].count("explicit_gemm()") == (2 if row["phase"] == "both" else 1)


def test_unsupported_backends_are_recorded_with_their_reason(suite):
    root, _ = suite
    rows = full_rows(root)
    wmma = get_algorithm("wmma_implicit_gemm")
    for row in (row for row in rows if row["backend"] == "wmma_implicit_gemm"):
        kernel_map = SparseTensor(np.zeros((1, 4), np.int32), np.zeros((1, 1), np.float32)).kernel_map(3).kernel_map
        features = np.zeros((1, int(row["in_channels"])), as_feature_dtype(row["dtype"]))
        problem = ConvProblem.of(features, kernel_map, int(row["out_channels"]))
        assert (row["status"], row["error"]) == ("not_supported", wmma.unsupported_reason(problem))
    spconv = [row for row in rows if row["backend"] == "spconv"]
    assert {row["status"] for row in spconv} == {"not_supported"}
    for row in spconv:
        if row["dtype"] == "bf16":
            assert row["error"] == "spconv 2.x runs fp16, fp32 and tf32, not bf16"
        elif row["phase"] in ("dgrad", "wgrad"):
            assert "both gradients at once" in row["error"]
        elif row["stride"] == "2":  # a 3^3 kernel at stride 2 makes other voxels in spconv
            assert row["error"].startswith("spconv's kernel size 3, stride 2 layer has other output voxels")
        else:
            assert row["error"] == "spconv runs on CUDA GPUs with torch only"
    assert all(row["median_ms"] == "" and row["tflops"] == "" for row in spconv)


def run_small(tmp_path, *extra):
    argv = ["--device", "cpu", "--num-voxels", "1000,2000", "--channels", "8,8", "--dtypes", "fp32", "--repeats",
            "1", "--iterations", "1", "--warmup", "0", "--output-dir", str(tmp_path / "out"), *extra]
    assert harness.main(argv) == 0
    return {(int(row["num_voxels"]), row["backend"], row["phase"]): row
            for row in read_csv(tmp_path / "out" / "benchmark_full.csv")[1]}


def test_an_injected_out_of_memory_stops_that_backend_and_phase_at_its_frontier(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning"))

    def out_of_memory(self, features, weight, kernel_map):
        raise MemoryError("out of memory (injected)")

    def broken(self, grad_output, weight, kernel_map):
        raise ValueError("injected failure")

    monkeypatch.setattr(ExplicitGemm, "forward", out_of_memory)
    monkeypatch.setattr(ExplicitGemm, "dgrad", broken)
    rows = run_small(tmp_path, "--backends", "explicit_gemm", "--phases", "forward,dgrad,wgrad")
    assert {key: (row["status"], row["error"]) for key, row in rows.items()} == {
        (1000, "explicit_gemm", "forward"): ("oom", "MemoryError: out of memory (injected) (cupysparse ran out of "
                                                    "memory in the forward of a convolution running explicit_gemm: "
                                                    "input 1,000 rows x 8 channels (31.2 KiB), output 1,000 rows x 8 "
                                                    "channels (31.2 KiB), weight 27 x 8 x 8 (6.75 KiB), float32)"),
        (2000, "explicit_gemm", "forward"): ("not_tested", "at least as large as 1,000 vox   8->8   k3 s1 fp32, "
                                                           "which ran out of memory"),
        (1000, "explicit_gemm", "dgrad"): ("error", "ValueError: injected failure"),
        (2000, "explicit_gemm", "dgrad"): ("error", "ValueError: injected failure"),
        (1000, "explicit_gemm", "wgrad"): ("ok", ""),
        (2000, "explicit_gemm", "wgrad"): ("ok", ""),
    }
    assert rows[(1000, "explicit_gemm", "forward")]["dispatched"] == "explicit_gemm()"


def test_a_terminated_grid_writes_the_rows_measured_before_it_and_exits_130(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning"))
    forward = ExplicitGemm.forward
    calls = []

    def terminated_on_the_second_layer(self, features, weight, kernel_map):
        calls.append(kernel_map.num_in)
        if len(set(calls)) == 2:  # the 2,000-voxel layer: as `timeout` would, mid-grid
            signal.raise_signal(signal.SIGTERM)
        return forward(self, features, weight, kernel_map)

    monkeypatch.setattr(ExplicitGemm, "forward", terminated_on_the_second_layer)
    argv = ["--device", "cpu", "--num-voxels", "1000,2000", "--channels", "8,8", "--dtypes", "fp32", "--repeats",
            "1", "--iterations", "1", "--warmup", "0", "--backends", "explicit_gemm", "--phases", "forward",
            "--output-dir", str(tmp_path / "out")]
    assert harness.main(argv) == 130
    rows = read_csv(tmp_path / "out" / "benchmark_full.csv")[1]
    assert [(row["num_voxels"], row["status"]) for row in rows] == [("1000", "ok")]
    assert float(rows[0]["median_ms"]) > 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the grid


def test_a_layer_too_large_to_build_is_recorded_and_larger_ones_are_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning"))
    built = []

    def build_map(coordinates, kernel_size, stride, device, warmup):
        built.append(len(coordinates))
        raise MemoryError("out of memory building the map (injected)")

    monkeypatch.setattr(harness, "build_map", build_map)
    rows = run_small(tmp_path, "--backends", "explicit_gemm,torch", "--phases", "forward,wgrad")
    assert len(built) == 1 and len(rows) == 8
    for (count, _, _), row in rows.items():
        if count == 1000:
            assert (row["status"], row["error"]) == (
                "oom", "building the layer: MemoryError: out of memory building the map (injected)")
        else:
            assert row["status"] == "not_tested"
        assert row["pairs"] == row["median_ms"] == ""


def test_the_memory_cap_marks_layers_estimated_too_large_as_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning"))
    rows = run_small(tmp_path, "--backends", "auto,implicit_gemm", "--phases", "forward", "--max-memory-gb", "1e-4")
    small, large = rows[(1000, "auto", "forward")], rows[(2000, "auto", "forward")]
    assert small["status"] == "oom" and small["error"].startswith("estimated ")
    assert small["error"].endswith("> --max-memory-gb 0.0001")
    assert float(small["estimated_mb"]) * 2**20 > 1e-4 * 2**30 and small["median_ms"] == ""
    assert large["status"] == "not_tested"
    assert {rows[(count, "implicit_gemm", "forward")]["status"] for count in (1000, 2000)} == {"not_supported"}
    with open(tmp_path / "out" / "memory_breakdown.csv") as handle:
        breakdown = list(csv.DictReader(handle))
    assert [(row["num_voxels"], row["status"]) for row in breakdown] == [("1000", "oom")]


def test_the_dtypes_of_one_layer_take_their_samples_in_turns(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning"))
    forward = ExplicitGemm.forward
    called = []

    def recording(self, features, weight, kernel_map):
        called.append(np.dtype(features.dtype).name)
        return forward(self, features, weight, kernel_map)

    monkeypatch.setattr(ExplicitGemm, "forward", recording)
    argv = ["--device", "cpu", "--num-voxels", "1000", "--channels", "8,8", "--dtypes", "fp32", "bf16", "--repeats",
            "3", "--iterations", "2", "--warmup", "1", "--backends", "explicit_gemm", "--phases", "forward",
            "--output-dir", str(tmp_path / "out")]
    assert harness.main(argv) == 0
    pair = ["float32", "bfloat16"]
    warmups, timed, peaks = pair, ["float32"] * 3 + ["bfloat16"] * 3, pair  # each batch after a call of its own
    assert called[-22:] == warmups + timed * 3 + peaks
    rows = read_csv(tmp_path / "out" / "benchmark_full.csv")[1]
    assert [(row["dtype"], row["status"], row["samples"]) for row in rows] == [("fp32", "ok", "3"), ("bf16", "ok", "3")]


def test_a_call_failing_while_sampled_leaves_the_turns_to_the_others():
    entered = []

    class Setting:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    failures = iter([None, None, None, MemoryError("out of memory (injected)")])

    def failing_on_its_fourth_call():
        error = next(failures, None)
        if error is not None:
            raise error

    calls = [(lambda: None, lambda: Setting("steady")), (failing_on_its_fourth_call, lambda: Setting("failing"))]
    steady, failing = interleaved_samples_ms(calls, "cpu", warmup=1, repeats=3, iterations=1)
    assert len(steady) == 3 and all(sample >= 0 for sample in steady)
    assert isinstance(failing, MemoryError)
    assert entered == ["steady", "failing"] + ["steady", "failing"] * 2 + ["steady"]


def test_layers_are_sampled_together_with_their_other_dtypes_unless_memory_is_capped():
    argv = ["--num-voxels", "1000,2000", "--channels", "8,8", "16,16", "--dtypes", "fp32", "bf16"]
    grid = harness.configurations(harness.parse_args(argv))
    together = harness.sampled_together(grid, dtypes_together=True)
    assert [[(config.num_voxels, config.in_channels, config.dtype) for config in group] for group in together] == [
        [(count, channels, "fp32"), (count, channels, "bf16")] for count in (1000, 2000) for channels in (8, 16)]
    assert harness.sampled_together(grid, dtypes_together=False) == [[config] for config in grid]


def test_out_of_memory_errors_of_every_library_are_recognised():
    torch = pytest.importorskip("torch")
    assert harness.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert harness.is_out_of_memory(MemoryError())
    assert harness.is_out_of_memory(RuntimeError("cudaErrorMemoryAllocation: out of memory"))
    assert not harness.is_out_of_memory(RuntimeError("illegal memory access"))


def test_cold_and_precompile_on_the_cpu_restore_the_cache_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning"))
    before = os.environ.get("CUPY_CACHE_DIR")
    rows = run_small(tmp_path, "--backends", "explicit_gemm", "--phases", "forward", "--cold", "--precompile")
    assert {row["status"] for row in rows.values()} == {"ok"}
    assert os.environ.get("CUPY_CACHE_DIR") == before
    assert os.environ["CUPYSPARSE_BENCHMARK_CACHE_DIR"] == str(tmp_path / "tuning")
    with open(tmp_path / "out" / "heatmap_data.json") as handle:
        metadata = json.load(handle)["metadata"]
    assert metadata["settings"]["cold"] is True and metadata["precompile"] == []
    assert not (tmp_path / "out" / "compile_times.csv").exists()


def test_the_kernel_modules_a_gpu_grid_needs_follow_backend_and_dtype():
    def problem(dtype, channels):
        return ConvProblem(100_000, 100_000, channels, channels, 27, np.dtype(dtype), "cuda", 90, (1, 1, 1))

    def needed(backends, problems):
        return sorted({(source.filename, " ".join(source.name_expressions).count("__half") > 0,
                        " ".join(source.name_expressions).count("__nv_bfloat16") > 0)
                       for source in harness.kernel_sources_needed(backends, problems)})

    # auto in fp16 on sm_90: tensor cores only (the three kernels, wgmma's where NVRTC compiles sm_90a, and
    # their wgrad sum); the fp16 modules, not the bf16 ones.
    wgmma = [("wgmma_implicit_gemm.cu", True, False)] if nvrtc_knows("sm_90a") else []
    assert needed(["auto", "spconv"], [problem(np.float16, 64)]) == [
        ("mma_implicit_gemm.cu", True, False), *wgmma, ("wgrad_sum.cu", True, False),
        ("wmma_implicit_gemm.cu", True, False),
    ]
    # auto in fp32 on a narrow layer: SIMT implicit GEMM (the module of fp32 and fp16); wide: cuBLAS, no module.
    assert needed(["auto"], [problem(np.float32, 32)]) == [("implicit_gemm.cu", True, False)]
    assert needed(["auto"], [problem(np.float32, 256)]) == []
    assert needed(["wmma_implicit_gemm", "explicit_gemm"], [problem(np.float32, 64)]) == []


@pytest.mark.parametrize(("kernel_size", "stride"), [(3, 1), (2, 2), (3, 2)])
def test_the_dense_torch_baseline_computes_our_convolution(kernel_size, stride):
    torch = pytest.importorskip("torch")
    voxels = make_scene("outdoor", 1000, seed=1).voxel_coordinates()
    coordinates = np.concatenate([np.zeros((len(voxels), 1), np.int32), voxels], axis=1)
    rng = np.random.default_rng(0)
    features = rng.standard_normal((len(voxels), 4))
    weight = rng.standard_normal((kernel_size**3, 4, 5))
    result = SparseTensor(coordinates, features).kernel_map(kernel_size, stride)
    ours = get_algorithm("explicit_gemm").forward(features, weight, result.kernel_map)
    config = harness.Configuration("outdoor", 1, 1000, 4, 5, kernel_size, stride, "fp64")
    dense = memory_analysis_backends.DenseTorchLayer(torch, coordinates, features, weight, config, "cpu")
    theirs = dense.output_rows(dense.forward(), result.out_coordinates).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-10, atol=1e-10)


def test_the_analysis_writes_every_plot_and_table(suite):
    root, _ = suite
    plots = root / "plots"
    for stem, _, _ in analysis.PLOTS:
        assert (plots / f"{stem}.png").stat().st_size > 1000
    expected_columns = {
        "summary_stats": analysis.SUMMARY_COLUMNS,
        "backward_forward_ratios": analysis.RATIO_COLUMNS,
        "crossover_points": analysis.CROSSOVER_COLUMNS,
        "baseline_ratios": analysis.BASELINE_COLUMNS,
    }
    tables = {}
    for name, columns in expected_columns.items():
        header, tables[name] = read_csv(plots / f"{name}.csv")
        assert tuple(header) == columns
    rows = full_rows(root)
    summary = {(row["backend"], row["phase"]): row for row in tables["summary_stats"]}
    assert len(summary) == 5 * len(harness.PHASES)
    assert summary[("wmma_implicit_gemm", "forward")]["not_supported"] == str(GRID_SIZE)
    assert summary[("auto", "both")]["ok"] == str(GRID_SIZE) and summary[("auto", "both")]["median_ms"] != ""

    def measured(backend, phase, key):
        return next(float(row["median_ms"]) for row in rows if (row["backend"], row["phase"]) == (backend, phase)
                    and tuple(row[column] for column in harness.KEY_COLUMNS) == key)

    ratios = tables["backward_forward_ratios"]
    assert len(ratios) == GRID_SIZE * len(RUNNABLE_ON_CPU)
    for row in ratios:
        key = tuple(row[column] for column in harness.KEY_COLUMNS)
        forward, backward = measured(row["backend"], "forward", key), measured(row["backend"], "backward", key)
        assert float(row["backward_forward_ratio"]) == pytest.approx(backward / forward, rel=1e-3)
    baseline = tables["baseline_ratios"]
    assert {row["backend"] for row in baseline} == {"auto", "torch"}
    assert len(baseline) == 2 * GRID_SIZE * len(harness.PHASES)
    for row in baseline:
        key = tuple(row[column] for column in harness.KEY_COLUMNS)
        ratio = measured(row["backend"], row["phase"], key) / measured("explicit_gemm", row["phase"], key)
        assert float(row["time_ratio"]) == pytest.approx(ratio, rel=1e-3)
        assert (row["memory_ratio"] == "") == (row["backend"] == "torch")


def test_the_results_page_is_deterministic_and_embeds_every_plot(suite):
    root, analysis_argv = suite
    page_path = root / "docs" / "benchmarks.md"
    first = page_path.read_text()
    assert analysis.main(analysis_argv) == 0
    assert page_path.read_text() == first
    images = [line[line.index("](") + 2 : -1] for line in first.splitlines() if line.startswith("![")]
    assert images == [f"../plots/{stem}.png" for stem, _, _ in analysis.PLOTS]
    assert all((page_path.parent / image).is_file() for image in images)
    with open(root / "results" / "heatmap_data.json") as handle:
        metadata = json.load(handle)["metadata"]
    assert f"Measured on **CPU (NumPy)** on {metadata['date']}." in first
    assert metadata["command"] in first and "cupysparse-analyze-benchmarks --input" in first
    assert f"numpy {np.__version__}" in first and "| auto | both | 16 | 16 |" in first


def hand_made_row(backend, count, dtype, ms, phase="forward"):
    return {"scene": "indoor", "batch_size": 1, "num_voxels": count, "in_channels": 32, "out_channels": 32,
            "kernel_size": 3, "stride": 1, "dtype": dtype, "backend": backend, "phase": phase, "status": "ok",
            "median_ms": ms}


def test_the_crossover_is_where_the_winner_changes_for_the_last_time():
    counts = (1000, 2000, 4000, 8000, 16000)
    # fp16: fast wins, slow wins at 2000 and 4000, then fast again from 8000 on.
    rows = [hand_made_row("fast", count, "fp16", ms) for count, ms in zip(counts, (1.0, 3.0, 5.0, 6.0, 9.0))]
    rows += [hand_made_row("slow", count, "fp16", ms) for count, ms in zip(counts, (2.0, 2.5, 4.5, 7.0, 12.0))]
    # fp32, the same voxel counts: slow always wins; merged on the voxel count alone it would mix in.
    rows += [hand_made_row("fast", count, "fp32", 10.0) for count in counts]
    rows += [hand_made_row("slow", count, "fp32", 1.0) for count in counts]
    # a backend measured at one size only, and a failed measurement: neither may move the answer.
    rows.append(hand_made_row("other", 1000, "fp16", 0.1))
    rows.append({**hand_made_row("slow", 32000, "fp16", None), "status": "oom"})
    assert analysis.crossover_points(rows) == [{
        "scene": "indoor", "batch_size": 1, "in_channels": 32, "out_channels": 32, "kernel_size": 3, "stride": 1,
        "dtype": "fp16", "phase": "forward", "backend_a": "fast", "backend_b": "slow", "winner_changes": 2,
        "last_before_num_voxels": 4000, "crossover_num_voxels": 8000, "winner_before": "slow",
        "winner_after": "fast",
    }]


def test_the_dtype_overhead_is_relative_to_the_fastest_dtype():
    rows = [hand_made_row("a", 1000, "fp16", 1.0), hand_made_row("a", 1000, "fp32", 2.0),
            hand_made_row("a", 2000, "fp16", 2.0), hand_made_row("a", 2000, "fp32", 8.0)]
    overheads = analysis.dtype_overheads(rows)
    assert overheads[("forward", "a")]["fp16"] == 1.0
    assert overheads[("forward", "a")]["fp32"] == pytest.approx(math.sqrt(2.0 * 4.0))


def test_without_matplotlib_the_analysis_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"pip install 'cupysparse\[plot\]'"):
        analysis.pyplot()


def test_tf32_is_fp32_features_with_tf32_products_and_needs_a_gpu(tmp_path, capsys):
    tf32 = harness.Configuration("indoor", 1, 1000, 8, 8, 3, 1, "tf32")
    fp32 = harness.Configuration("indoor", 1, 1000, 8, 8, 3, 1, "fp32")
    assert (tf32.feature_dtype, tf32.fp32_precision) == (np.dtype(np.float32), "tf32")
    assert (fp32.feature_dtype, fp32.fp32_precision) == (np.dtype(np.float32), "ieee")
    assert tf32.at_least_as_large_as(fp32) and fp32.at_least_as_large_as(tf32)
    argv = ["--device", "cpu", "--num-voxels", "1000", "--channels", "8,8", "--dtypes", "fp32", "tf32",
            "--output-dir", str(tmp_path / "out")]
    assert harness.main(argv) == 2
    assert "TF32 runs on GPU tensor cores" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
