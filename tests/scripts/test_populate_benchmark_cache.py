"""populate_benchmark_cache end to end on the CPU: the grid, a real run into a temporary cache,
--resume, a failing configuration, and an interrupted run resumed."""

import csv
import math

import pytest
from cupysparse.scripts import populate_benchmark_cache as populate

from cupysparse.tuning import cache_file as benchmark_cache
from cupysparse.tuning.cache_file import BenchmarkCache, cache_file_path
from cupysparse.tuning.tuner import default_tuner

TINY_RUN = ["--device", "cpu", "--num-voxels", "2000", "--channels", "4,8", "--dtypes", "float32",
            "--kernel-sizes", "3", "--algo-mode", "all"]
NAMESPACES = ("sparse_conv_forward", "sparse_conv_backward")


@pytest.fixture(autouse=True)
def temporary_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)


def saved_entries(namespace):
    return BenchmarkCache(cache_file_path(), autosave=False).entries(namespace)


def test_default_channel_pairs_are_26_with_the_stem():
    pairs = populate.DEFAULT_CHANNEL_PAIRS
    assert len(pairs) == 26 == len(set(pairs))
    assert (3, 32) in pairs
    every_listed = {pair for pairs in populate.ARCHITECTURE_CHANNEL_PAIRS.values() for pair in pairs}
    assert set(pairs) == every_listed


def test_dry_run_of_the_default_preset_lists_364_configurations(capsys):
    assert populate.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "364 configurations"
    assert [line.split(".")[0].strip() for line in lines[:-1]] == [str(i) for i in range(1, 365)]
    assert not cache_file_path().exists()


def test_dry_run_of_the_quick_preset_lists_6(capsys):
    assert populate.main(["--preset", "quick", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "6 configurations"


def test_voxel_counts_of_one_size_bucket_are_one_configuration():
    grid = populate.configurations((30_000, 32_000, 40_000, 65_000), ((3, 32),), (3,), ("float16",))
    assert [config.num_voxels for config in grid] == [30_000, 40_000]


def test_a_run_on_the_cpu_stores_both_phases_and_resume_skips_them(capsys):
    assert populate.main(TINY_RUN) == 0
    output = capsys.readouterr().out
    assert "forward: explicit_gemm" in output and "backward: explicit_gemm" in output
    assert output.count("(measured, tuning") == 2
    assert "done 1, skipped 0 (already cached), failed 0" in output and str(cache_file_path()) in output
    for namespace in NAMESPACES:
        (entry,) = saved_entries(namespace)
        key = dict(entry.key)
        assert (key["in_channels"], key["out_channels"], key["kernel_volume"]) == (4, 8, 27)
        assert key["compute_capability"] == "cpu" and key["in_dtype"] == "float32"
        assert key["log_num_in_coords"] == math.ceil(math.log2(2000))  # the scene is cut to ≤ 2000 voxels
        assert entry.results[0][0] == "explicit_gemm" and entry.results[0][2] > 0
    written = {namespace: saved_entries(namespace)[0].updated for namespace in NAMESPACES}

    assert populate.main([*TINY_RUN, "--resume"]) == 0
    output = capsys.readouterr().out
    assert "skipped: already cached" in output and "done 0, skipped 1 (already cached), failed 0" in output
    assert {namespace: saved_entries(namespace)[0].updated for namespace in NAMESPACES} == written

    assert populate.main(TINY_RUN) == 0  # without --resume: looked up, nothing measured again
    assert capsys.readouterr().out.count("(cached, tuning") == 2


def test_resume_runs_only_the_missing_phase(capsys):
    assert populate.main([*TINY_RUN, "--forward-only"]) == 0
    assert saved_entries("sparse_conv_backward") == []
    assert populate.main([*TINY_RUN, "--resume"]) == 0
    output = capsys.readouterr().out.splitlines()
    result = next(line for line in output if line.startswith("[1/1]") and "backward" in line)
    assert "forward:" not in result
    assert len(saved_entries("sparse_conv_backward")) == 1


def test_a_failing_configuration_is_reported_and_the_others_still_run(monkeypatch, capsys):
    real_runner = populate.LayerData.runner

    def runner_failing_for_c_in_4(data, phase):
        if data.features.shape[1] == 4:
            raise RuntimeError("injected failure")
        return real_runner(data, phase)

    monkeypatch.setattr(populate.LayerData, "runner", runner_failing_for_c_in_4)
    argv = ["--device", "cpu", "--num-voxels", "2000", "--channels", "4,8", "8,8", "--dtypes", "float32"]
    assert populate.main(argv) == 1
    output = capsys.readouterr().out
    assert "4->8" in output and "FAILED: RuntimeError: injected failure" in output
    assert "done 1, skipped 0 (already cached), failed 1" in output
    (entry,) = saved_entries("sparse_conv_forward")
    assert dict(entry.key)["in_channels"] == 8


def test_bad_flags_are_rejected():
    for argv in (["--channels", "3-32"], ["--algo-mode", "fastest"], ["--num-voxels", "500", "--batch-size", "2"],
                 ["--forward-only", "--backward-only"]):
        with pytest.raises(SystemExit):
            populate.parse_args(argv)


def first_call_rows(tmp_path) -> list[dict]:
    from cupysparse.scripts import benchmark_first_call

    csv_path = tmp_path / "first_call.csv"
    assert benchmark_first_call.main([*TINY_RUN, "--repeats", "2", "--csv", str(csv_path)]) == 0
    return list(csv.DictReader(csv_path.open()))


def test_first_call_benchmark_measures_nothing_after_populating(tmp_path, monkeypatch):
    # On the CPU explicit_gemm is the only candidate, which calls do not time unless asked to.
    monkeypatch.setattr(default_tuner(), "_measure_single", True)
    default_tuner().forget_choices()
    assert [row["benchmarked"] for row in first_call_rows(tmp_path)] == ["1", "1"]  # an empty cache

    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "populated"))
    default_tuner().forget_choices()
    assert populate.main(TINY_RUN) == 0
    rows = first_call_rows(tmp_path)
    assert [row["phase"] for row in rows] == ["forward", "backward"]
    for row in rows:
        assert row["benchmarked"] == "0" and float(row["first_ms"]) > 0 and float(row["steady_ms"]) > 0
        assert float(row["ratio"]) == pytest.approx(float(row["first_ms"]) / float(row["steady_ms"]), abs=0.01)


def test_populate_inspect_and_analyze_end_to_end_on_the_cpu(tmp_path, capsys):
    from cupysparse.scripts import analyze_autotune_cache as analyze
    from cupysparse.scripts import inspect_benchmark_cache as inspect_cache

    scaled_down_quick = ["--preset", "quick", "--device", "cpu", "--num-voxels", "2000,3000", "--dtypes", "float32",
                         "--channels", "4,8", "8,8", "--algo-mode", "all"]
    assert populate.main(scaled_down_quick) == 0
    assert "done 4, skipped 0 (already cached), failed 0" in capsys.readouterr().out

    assert inspect_cache.main(["namespace=sparse_conv_forward"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Namespace: sparse_conv_forward (4 configurations)\n")
    blocks = out.split("-" * 40 + "\nConfiguration ")[1:]
    assert len(blocks) == 4
    for number, block in enumerate(blocks, 1):
        lines = block.splitlines()
        assert lines[:3] == [f"{number}:", "-" * 40, "Config Parameters:"]
        names = [line.split(":")[0].strip() for line in lines[3:13]]
        assert names == ["log_num_in_coords", "log_num_out_coords", "in_channels", "out_channels", "kernel_volume",
                         "in_dtype", "compute_capability", "stride", "transposed", "generative"]
        assert lines[13:16] == ["", "Results:", "  ["] and lines[17] == "  ]"
        assert lines[16].startswith('    ["explicit_gemm", {}, ') and float(lines[16].split(", ")[-1][:-1]) > 0
    pairs = {(block.split("in_channels: ")[1].split()[0], block.split("out_channels: ")[1].split()[0])
             for block in blocks}
    assert pairs == {("4", "8"), ("8", "8")}

    report = tmp_path / "analysis.md"
    assert analyze.main(["--markdown", "--output", str(report)]) == 0
    text = report.read_text()
    assert "## sparse_conv_forward (4 configurations)" in text and "## sparse_conv_backward (4 configurations)" in text
    assert "| explicit_gemm | 4 | 100.0% | 100.0% | 4 |" in text
    assert "| 1 | explicit_gemm | 4/4 (100.0%) |" in text


def saved_pairs(namespace) -> set:
    return {(dict(entry.key)["in_channels"], dict(entry.key)["out_channels"]) for entry in saved_entries(namespace)}


def test_an_interrupted_run_keeps_what_it_measured_and_resume_measures_only_the_rest(monkeypatch, capsys):
    monkeypatch.setattr(benchmark_cache, "SAVE_DELAY_S", 3600)  # no background save: only the script's own
    argv = ["--device", "cpu", "--num-voxels", "2000", "--channels", "4,8", "8,8", "8,16", "--dtypes", "float32",
            "--algo-mode", "all"]
    real_runner = populate.LayerData.runner
    on_disk_at_interruption = {}
    measured = []

    def runner(data, phase):
        run = real_runner(data, phase)
        pair = (data.problem.in_channels, data.problem.out_channels)

        def interrupted_run(algorithm, params):
            if pair == (8, 16) and phase == "backward":  # Ctrl-C in the middle of the third configuration
                on_disk_at_interruption.update({ns: saved_pairs(ns) for ns in NAMESPACES})
                raise KeyboardInterrupt
            measured.append((pair, phase))
            return run(algorithm, params)

        return interrupted_run

    monkeypatch.setattr(populate.LayerData, "runner", runner)
    assert populate.main(argv) == 130
    output = capsys.readouterr().out
    assert "interrupted in configuration 3/3 after 2 done" in output and "--resume" in output
    # Saved as it went: the two finished configurations and the third's forward were on disk already.
    assert on_disk_at_interruption == {"sparse_conv_forward": {(4, 8), (8, 8), (8, 16)},
                                       "sparse_conv_backward": {(4, 8), (8, 8)}}
    assert saved_pairs("sparse_conv_backward") == {(4, 8), (8, 8)}
    written = {ns: {entry.key: entry.updated for entry in saved_entries(ns)} for ns in NAMESPACES}

    monkeypatch.setattr(benchmark_cache, "_default_cache", None)  # a new process: the cache comes from disk
    def recording_runner(data, phase):
        measured.append(((data.problem.in_channels, data.problem.out_channels), phase))
        return real_runner(data, phase)

    monkeypatch.setattr(populate.LayerData, "runner", recording_runner)
    measured.clear()
    assert populate.main([*argv, "--resume"]) == 0
    output = capsys.readouterr().out
    assert "done 1, skipped 2 (already cached), failed 0" in output
    assert measured == [((8, 16), "backward")]  # the one phase missing, nothing else
    for namespace in NAMESPACES:
        assert saved_pairs(namespace) == {(4, 8), (8, 8), (8, 16)}
        updated = {entry.key: entry.updated for entry in saved_entries(namespace)}
        assert all(updated[key] == when for key, when in written[namespace].items())  # earlier results untouched


def test_a_configuration_that_ran_out_of_memory_is_reported_uncached_and_resume_measures_it(monkeypatch, capsys):
    real_runner = populate.LayerData.runner
    memory = {"short": True}

    def runner_short_of_memory_for_c_in_8(data, phase):
        run = real_runner(data, phase)

        def maybe_out_of_memory(algorithm, params):
            if memory["short"] and data.problem.in_channels == 8:
                raise MemoryError("Unable to allocate 12.0 GiB for an array with shape (200000, 16384)")
            return run(algorithm, params)

        return maybe_out_of_memory

    monkeypatch.setattr(populate.LayerData, "runner", runner_short_of_memory_for_c_in_8)
    argv = ["--device", "cpu", "--num-voxels", "2000", "--channels", "4,8", "8,8", "--dtypes", "float32",
            "--forward-only"]
    with pytest.warns(RuntimeWarning, match="the reference explicit_gemm ran out of memory .*12.0 GiB"):
        assert populate.main(argv) == 1
    output = capsys.readouterr().out
    assert "8->8" in output and "FAILED: RuntimeError: the tuner stored no sparse_conv_forward result" in output
    assert "done 1, skipped 0 (already cached), failed 1" in output
    assert saved_pairs("sparse_conv_forward") == {(4, 8)}

    memory["short"] = False
    assert populate.main([*argv, "--resume"]) == 0
    assert "done 1, skipped 1 (already cached), failed 0" in capsys.readouterr().out
    assert saved_pairs("sparse_conv_forward") == {(4, 8), (8, 8)}
