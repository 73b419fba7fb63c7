"""populate_shipped_cache end to end on the CPU: every layer of the network on the scene, both phases,
written to the output file alone (the user's cache untouched, no lock file beside the output)."""

import numpy as np
import pytest
from cupysparse.scripts import populate_shipped_cache as populate
from cupysparse.scripts.demo import scene_tensor

from cupysparse.networks import descriptions as networks
from cupysparse.cuda.compile import KERNEL_DIR, source_digest
from cupysparse.tuning import shipped
from cupysparse.tuning.cache_file import BenchmarkCache, open_for_reading
from cupysparse.data.scenes import INDOOR_CLASSES, OUTDOOR_CLASSES
from cupysparse.tuning.shipped import shipped_cache_path
from cupysparse.tuning.tuner import Tuner
from cupysparse.geometry.padding import spconv_grid
from cupysparse.networks.tuning import tune_network

TINY_RUN = ["--device", "cpu", "--num-voxels", "2000", "--dtypes", "float32"]


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)
    return tmp_path / "user"


def layer_signatures(network):
    return {(conv.in_channels, conv.out_channels, conv.kernel_volume(), conv.transposed)
            for _, conv in networks.convolutions(network)}


def test_the_output_holds_every_layer_of_each_network_on_each_scene_forward_and_backward(tmp_path, user_cache, capsys):
    output = tmp_path / "shipped" / "benchmark_cache_test.msgpack"
    assert populate.main([*TINY_RUN, "--output", str(output)]) == 0
    out = capsys.readouterr().out
    for run in ("MinkUNet18 on the indoor scene", "MinkUNet18 on the outdoor scene",
                "CenterPointBackbone on the outdoor scene",
                "CenterPointBackbone (spconv's padding) on the outdoor scene"):
        assert run in out
    written = open_for_reading(output)
    expected = (layer_signatures(networks.minkunet(18, 3, len(INDOOR_CLASSES)))
                | layer_signatures(networks.minkunet(18, 3, len(OUTDOOR_CLASSES)))  # its classifier on the sweep
                | layer_signatures(networks.centerpoint_backbone()))
    for namespace in ("sparse_conv_forward", "sparse_conv_backward"):
        keys = [dict(entry.key) for entry in written.entries(namespace)]
        assert {(k["in_channels"], k["out_channels"], k["kernel_volume"], k["transposed"]) for k in keys} == expected
        assert {k["compute_capability"] for k in keys} == {"cpu"} and {k["in_dtype"] for k in keys} == {"float32"}
    assert [path.name for path in output.parent.iterdir()] == [output.name]
    assert not user_cache.exists()


def test_the_padded_backbone_is_tuned_on_spconvs_grid(tmp_path):
    """Its input is the scene placed as spconv's detectors place it (padded outputs depend on the grid), and its
    keys are those of its padded maps there."""
    network, base = populate.network_input("centerpoint-padded", "outdoor", 2000, "cpu")
    assert networks.has_padding(network)
    _, tensor, _ = scene_tensor("outdoor", 2000, populate.SCENE_SEED, "cpu", "float32")
    coordinates, spatial_shape = spconv_grid(tensor.coordinates, networks.coarsest_stride(network))
    assert np.array_equal(base.coordinates, coordinates) and base.spatial_shape == tuple(spatial_shape)
    assert populate.network_input("centerpoint", "outdoor", 2000, "cpu")[1].spatial_shape is None

    output = tmp_path / "cache.msgpack"
    assert populate.main([*TINY_RUN, "--networks", "centerpoint-padded", "--output", str(output)]) == 0
    choices = tune_network(network, base, Tuner(BenchmarkCache(tmp_path / "expected.msgpack", autosave=False)))
    assert {key for namespace, key in entries_by_key(output) if namespace == "sparse_conv_forward"} == {
        choice.key for choice in choices if choice.phase == "forward"}


def test_a_second_run_replaces_the_output(tmp_path):
    output = tmp_path / "cache.msgpack"
    output.write_bytes(b"an older file")
    assert populate.main([*TINY_RUN, "--output", str(output)]) == 0
    assert open_for_reading(output).namespace_counts()["sparse_conv_forward"] > 0


def test_dry_run_lists_network_scene_size_and_dtype_runs(capsys):
    assert populate.main(["--dry-run", "--num-voxels", "100K", "200K", "--dtypes", "float16", "tf32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # MinkUNet18 on both scenes and CenterPoint's backbone (ours, spconv's padded) on the sweep, two sizes, two dtypes
    assert lines[-1] == "16 runs"
    assert "100,000 voxels  float16" in lines[0] and "200,000 voxels  tf32" in lines[3]
    assert [(line.split()[0], line.split()[-1]) for line in lines[:-1:4]] == [
        ("indoor", "minkunet18"), ("outdoor", "minkunet18"), ("outdoor", "centerpoint"),
        ("outdoor", "centerpoint-padded")]


def test_scenes_choose_the_runs_and_a_choice_no_network_runs_on_is_refused(capsys):
    assert populate.main(["--dry-run", "--scenes", "outdoor", "--num-voxels", "100K", "--dtypes", "float16"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "outdoor     100,000 voxels  float16   minkunet18", "outdoor     100,000 voxels  float16   centerpoint",
        "outdoor     100,000 voxels  float16   centerpoint-padded", "3 runs"]
    with pytest.raises(SystemExit):
        populate.main(["--dry-run", "--networks", "centerpoint", "centerpoint-padded", "--scenes", "indoor"])
    assert ("no network runs on the scenes named by --scenes (centerpoint on outdoor; centerpoint-padded on outdoor)"
            in capsys.readouterr().err)


def entries_by_key(path):
    cache = open_for_reading(path)
    return {(namespace, entry.key): entry.results for namespace in cache.namespace_counts()
            for entry in cache.entries(namespace)}


def test_extend_keeps_the_files_entries_and_measures_only_the_keys_it_lacks(tmp_path, capsys):
    output = tmp_path / "cache.msgpack"
    indoor = [*TINY_RUN, "--networks", "minkunet18", "--output", str(output)]
    assert populate.main([*indoor, "--scenes", "indoor"]) == 0
    kept = entries_by_key(output)
    capsys.readouterr()
    assert populate.main([*indoor, "--extend"]) == 0
    out = capsys.readouterr().out
    assert f"keeping its {len(kept)} entries" in out
    assert "MinkUNet18 on the indoor scene, 2,027 voxels, float32: 50 convolutions, 0 problems measured" in out
    extended = entries_by_key(output)
    assert {key: extended[key] for key in kept} == kept  # the indoor results as they were, not measured again
    assert len(extended) > len(kept)  # the sweep's coarse levels meet other sizes
    assert [path.name for path in tmp_path.iterdir()] == [output.name]


def test_extend_refuses_a_missing_file_and_one_that_is_no_cache_and_leaves_it_alone(tmp_path, capsys):
    missing = tmp_path / "missing.msgpack"
    assert populate.main([*TINY_RUN, "--extend", "--output", str(missing)]) == 2
    assert f"there is no file {missing} to extend" in capsys.readouterr().err
    assert not missing.exists()
    damaged = tmp_path / "damaged.msgpack"
    damaged.write_bytes(b"\x92\x01\x02")
    assert populate.main([*TINY_RUN, "--extend", "--output", str(damaged)]) == 2
    assert f"{damaged} cannot be read as a tuning cache" in capsys.readouterr().err
    assert damaged.read_bytes() == b"\x92\x01\x02"


def test_cpu_results_need_an_explicit_output_and_the_default_is_the_shipped_file(capsys):
    with pytest.raises(SystemExit):
        populate.main(["--device", "cpu"])
    assert "--output" in capsys.readouterr().err
    assert shipped_cache_path("sm_90").name == "benchmark_cache_sm_90.msgpack"


# ---- the release check (--check) ----

KERNEL_FILES = sorted(path.name for path in KERNEL_DIR.glob("*.cu"))[:3]
RESULTS = [("implicit_gemm", {"fwd_block_size": 16}, 0.25)]


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    directory = tmp_path / "shipped"
    directory.mkdir()
    monkeypatch.setattr(shipped, "SHIPPED_CACHE_DIR", directory)
    return directory


def write_shipped(path, stale_files=(), architecture=None):
    """An entry per kernel file of KERNEL_FILES, recorded at today's digest unless named in `stale_files`,
    and one that measured no kernel file; keyed for the file's architecture unless told another."""
    cache = BenchmarkCache(path, autosave=False)
    key = (("in_channels", 32), ("compute_capability", architecture or shipped.shipped_architecture(path)))
    for filename in KERNEL_FILES:
        digest = "0" * 16 if filename in stale_files else source_digest(filename)
        cache.put("ns", (*key, ("measured", filename)), RESULTS, [(filename, digest)])
    cache.put("ns", (*key, ("measured", "nothing")), RESULTS)
    cache.save()
    return path


ENTRIES = len(KERNEL_FILES) + 1


def run_check(capsys, *argv):
    status = populate.main(["--check", *argv])
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err


def test_the_release_check_passes_files_that_match_the_kernel_sources(shipped_dir, capsys):
    write_shipped(shipped_dir / "benchmark_cache_sm_90.msgpack")
    assert run_check(capsys) == (0, [
        f"benchmark_cache_sm_90.msgpack (sm_90): {ENTRIES} entries, {ENTRIES} fresh, 0 stale",
        "1 of 1 shipped tuning files match the kernel sources",
    ], "")


def test_the_release_check_fails_on_stale_entries_and_names_the_changed_files(shipped_dir, capsys):
    write_shipped(shipped_dir / "benchmark_cache_sm_80.msgpack")
    stale = write_shipped(shipped_dir / "benchmark_cache_sm_90.msgpack", stale_files=KERNEL_FILES[:2])
    status, out, _ = run_check(capsys)
    assert status == 1
    assert out == [
        f"benchmark_cache_sm_80.msgpack (sm_80): {ENTRIES} entries, {ENTRIES} fresh, 0 stale",
        f"benchmark_cache_sm_90.msgpack (sm_90): {ENTRIES} entries, {ENTRIES - 2} fresh, 2 stale",
        *(f"  {name}: 1 stale (it or a header it includes changed since measured)" for name in KERNEL_FILES[:2]),
        f"  re-populate it on an sm_90 GPU: cupysparse-populate-shipped-cache --output {stale}",
        "1 of 2 shipped tuning files match the kernel sources",
    ]


def test_the_release_check_fails_on_entries_of_another_architecture(shipped_dir, capsys):
    write_shipped(shipped_dir / "benchmark_cache_sm_90.msgpack", architecture="sm_80")
    status, out, _ = run_check(capsys)
    assert status == 1
    assert f"  {ENTRIES} keyed for another architecture than sm_90 (never looked up in this file)" in out


def test_the_release_check_fails_on_a_file_that_is_no_cache_and_leaves_it_alone(shipped_dir, capsys):
    path = shipped_dir / "benchmark_cache_sm_90.msgpack"
    path.write_bytes(b"\x92\x01\x02")
    status, out, _ = run_check(capsys)
    assert status == 1
    assert out[0].startswith("benchmark_cache_sm_90.msgpack: cannot be read as a tuning cache: ")
    assert path.read_bytes() == b"\x92\x01\x02" and [p.name for p in shipped_dir.iterdir()] == [path.name]


def test_the_release_check_of_named_files_and_of_none(shipped_dir, tmp_path, capsys):
    named = write_shipped(tmp_path / "benchmark_cache_sm_90.msgpack", stale_files=KERNEL_FILES[:1])
    status, out, _ = run_check(capsys, str(named))
    assert status == 1 and out[-1] == "0 of 1 shipped tuning files match the kernel sources"
    status, out, err = run_check(capsys)  # this install's folder holds none
    assert (status, out, err) == (1, [], "no shipped tuning files to check\n")
