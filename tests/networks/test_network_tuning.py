"""`networks.tuning.tune_network` on the CPU: it meets the problems a training step of the torch network
meets on the same scene, and leaves the default tuner's cache alone."""

import pytest

from cupysparse.networks import descriptions as networks
from cupysparse.tuning import tuner as tuner_module
from cupysparse.tuning.cache_file import BenchmarkCache
from cupysparse.scripts.demo import scene_tensor
from cupysparse.networks.tuning import tune_network
from cupysparse.tuning.tuner import NAMESPACES, Tuner, tuning_key

WIDTH = 0.25
NUM_VOXELS = 2000


@pytest.fixture
def scene():
    return scene_tensor("indoor", NUM_VOXELS, 0, "cpu", "float32")


def problems_met(monkeypatch, step) -> dict[str, set]:
    """The tuning keys the default tuner is asked to select for while `step()` runs, by phase."""
    met = {"forward": set(), "backward": set()}
    default_select = tuner_module.default_tuner().select

    def recording_select(search_space, problem, run=None):
        met[search_space.phase].add(tuning_key(problem))
        return default_select(search_space, problem, run)

    monkeypatch.setattr(tuner_module.default_tuner(), "select", recording_select)
    step()
    monkeypatch.setattr(tuner_module.default_tuner(), "select", default_select)  # what the step met, only
    return met


def test_every_layer_is_tuned_forward_and_backward_under_the_keys_of_a_torch_training_step(scene, monkeypatch,
                                                                                           tmp_path):
    torch = pytest.importorskip("torch")
    from cupysparse.adapters.torch import SparseTensor
    from cupysparse.adapters.torch.networks import MinkUNet18

    _, tensor, labels = scene
    model = MinkUNet18(3, 13, WIDTH)
    torch_input = SparseTensor(torch.from_numpy(tensor.coordinates), torch.from_numpy(tensor.features))
    met = problems_met(monkeypatch, lambda: torch.nn.functional.cross_entropy(
        model(torch_input).features, torch.from_numpy(labels)).backward())
    assert met["forward"] and met["backward"]

    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "user"))
    cache = BenchmarkCache(tmp_path / "network.msgpack", autosave=False)
    choices = tune_network(networks.minkunet(18, 3, 13, WIDTH), tensor, Tuner(cache, measure_single_candidates=True))
    description = networks.minkunet(18, 3, 13, WIDTH)
    assert [c.path for c in choices[::2]] == [path for path, _ in networks.convolutions(description)]
    for phase in ("forward", "backward"):
        tuned = {c.key for c in choices if c.phase == phase}
        assert tuned == met[phase]
        assert {dict(key)["in_dtype"] for key in tuned} == {"float32"}
        assert all(cache.get(NAMESPACES[("conv", phase)], key) is not None for key in tuned)
    assert not (tmp_path / "user").exists()  # the default tuner's cache was not touched


def test_a_padded_network_is_tuned_on_the_maps_its_padded_convolutions_run_on(monkeypatch, tmp_path):
    """spconv's padded strided convolutions reach more outputs than ours: each layer's problem is the one the
    torch step meets on the same input, on spconv's grid."""
    torch = pytest.importorskip("torch")
    from cupysparse.adapters.torch import SparseTensor
    from cupysparse.adapters.torch.networks import CenterPointBackbone
    from cupysparse.geometry.padding import spconv_grid
    from cupysparse.geometry.sparse_tensor import SparseTensor as CoreSparseTensor

    description = networks.centerpoint_backbone(3, WIDTH, padded=True)
    _, tensor, _ = scene_tensor("outdoor", NUM_VOXELS, 0, "cpu", "float32")
    coordinates, spatial_shape = spconv_grid(tensor.coordinates, networks.coarsest_stride(description))
    model = CenterPointBackbone(3, WIDTH, padded=True)
    torch_input = SparseTensor(torch.from_numpy(coordinates), torch.from_numpy(tensor.features),
                               spatial_shape=spatial_shape)
    met = problems_met(monkeypatch, lambda: model(torch_input).features.square().mean().backward())

    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "user"))
    core_input = CoreSparseTensor(coordinates, tensor.features, spatial_shape=spatial_shape)
    choices = tune_network(description, core_input, Tuner(BenchmarkCache(tmp_path / "network.msgpack",
                                                                          autosave=False)))
    for phase in ("forward", "backward"):
        assert {c.key for c in choices if c.phase == phase} == met[phase]


def test_phases_are_checked(scene):
    _, tensor, _ = scene
    with pytest.raises(ValueError, match="phases"):
        tune_network(networks.minkunet(18, 3, 13, WIDTH), tensor, Tuner(), phases=("sideways",))
