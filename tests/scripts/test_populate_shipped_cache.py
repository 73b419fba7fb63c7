"""populate_shipped_cache end to end on the CPU: every layer of the network on the scene, both phases,
written to the output file alone (the user's cache untouched, no lock file beside the output)."""

import pytest
from cupysparse.scripts import populate_shipped_cache as populate

from cupysparse.networks import descriptions as networks
from cupysparse.tuning.cache_file import open_for_reading
from cupysparse.data.scenes import INDOOR_CLASSES
from cupysparse.tuning.shipped import shipped_cache_path

TINY_RUN = ["--device", "cpu", "--num-voxels", "2000", "--dtypes", "float32"]


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)
    return tmp_path / "user"


def layer_signatures(network):
    return {(conv.in_channels, conv.out_channels, conv.kernel_volume(), conv.transposed)
            for _, conv in networks.convolutions(network)}


def test_the_output_holds_every_layer_of_both_networks_forward_and_backward(tmp_path, user_cache, capsys):
    output = tmp_path / "shipped" / "benchmark_cache_test.msgpack"
    assert populate.main([*TINY_RUN, "--networks", "minkunet18", "centerpoint", "--output", str(output)]) == 0
    assert "MinkUNet18 on the indoor scene" in capsys.readouterr().out
    written = open_for_reading(output)
    expected = (layer_signatures(networks.minkunet(18, 3, len(INDOOR_CLASSES)))
                | layer_signatures(networks.centerpoint_backbone()))
    for namespace in ("sparse_conv_forward", "sparse_conv_backward"):
        keys = [dict(entry.key) for entry in written.entries(namespace)]
        assert {(k["in_channels"], k["out_channels"], k["kernel_volume"], k["transposed"]) for k in keys} == expected
        assert {k["compute_capability"] for k in keys} == {"cpu"} and {k["in_dtype"] for k in keys} == {"float32"}
    assert [path.name for path in output.parent.iterdir()] == [output.name]
    assert not user_cache.exists()


def test_a_second_run_replaces_the_output(tmp_path):
    output = tmp_path / "cache.msgpack"
    output.write_bytes(b"an older file")
    assert populate.main([*TINY_RUN, "--output", str(output)]) == 0
    assert open_for_reading(output).namespace_counts()["sparse_conv_forward"] > 0


def test_dry_run_lists_network_size_and_dtype_runs(capsys):
    assert populate.main(["--dry-run", "--num-voxels", "100K", "200K", "--dtypes", "float16", "tf32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "4 runs"
    assert "100,000 voxels  float16" in lines[0] and "200,000 voxels  tf32" in lines[3]


def test_cpu_results_need_an_explicit_output_and_the_default_is_the_shipped_file(capsys):
    with pytest.raises(SystemExit):
        populate.main(["--device", "cpu"])
    assert "--output" in capsys.readouterr().err
    assert shipped_cache_path("sm_90").name == "benchmark_cache_sm_90.msgpack"
