"""The reference networks: one description, PyTorch modules and framework-free inference that agree.

The PyTorch modules (eval mode, float64) are the reference for `cupysparse.networks.inference`, which runs
the same description with the weights saved from them, batch norm folded into the convolutions
or not. Batch-norm statistics are randomised so a wrong fold or a swapped skip shows.
"""

import math

import numpy as np
import pytest

from cupysparse import SparseTensor
from cupysparse.geometry import MapRequest
from cupysparse.networks import descriptions as networks
from cupysparse.networks.inference import InferenceNetwork
from cupysparse.data.scenes import make_scene
from cupysparse.networks.weights_file import load_weights, save_weights

torch = pytest.importorskip("torch")
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.adapters.torch import networks as torch_networks  # noqa: E402

FP32_RTOL = 1e-4  # the design notes' fp32 tolerance, relative to the largest output
NUM_CLASSES = 5


def _voxels(scene_kind: str, num_voxels: int, in_channels: int, seed: int = 0) -> SparseTensor:
    scene = make_scene(scene_kind, num_voxels, seed=seed)
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((len(scene.points), in_channels)).astype(np.float32)
    return SparseTensor.from_points(scene.points, scene.voxel_size, features=features, reduce="first")


def _randomise_batch_norms(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                for tensor, low, high in ((module.running_mean, -0.5, 0.5), (module.running_var, 0.5, 2.0),
                                          (module.weight, 0.5, 1.5), (module.bias, -0.3, 0.3)):
                    tensor.copy_(torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype) * (high - low) + low)


def _torch_output(model, tensor: SparseTensor, dtype) -> np.ndarray:
    x = cst.SparseTensor(torch.from_numpy(tensor.coordinates), torch.from_numpy(tensor.features).to(dtype))
    with torch.no_grad():
        return model.eval()(x).features.double().numpy()


DESCRIPTIONS = {
    "MinkUNet14": lambda: networks.minkunet(14, 3, NUM_CLASSES, width=0.5),
    "MinkUNet18": lambda: networks.minkunet(18, 3, NUM_CLASSES, width=0.25),
    "MinkUNet34": lambda: networks.minkunet(34, 3, NUM_CLASSES, width=0.25),
    "CenterPointBackbone": lambda: networks.centerpoint_backbone(4, width=0.5),
}


@pytest.mark.parametrize("name", sorted(DESCRIPTIONS))
def test_torch_state_dict_has_exactly_the_described_parameters(name):
    description = DESCRIPTIONS[name]()
    model = torch_networks.SparseNetwork(description)
    state = {key: tuple(value.shape) for key, value in model.state_dict().items()
             if not key.endswith("num_batches_tracked")}
    assert state == networks.parameter_shapes(description)


def test_minkunet_channel_progression_and_parameter_count():
    description = networks.minkunet(18, 3, 20)
    convs = dict(networks.convolutions(description))
    assert convs["stem.first_conv"].out_channels == 32
    assert [convs[f"encoder{i}.block1.conv2"].out_channels for i in range(1, 5)] == [32, 64, 128, 256]
    assert [convs[f"decoder{i}.block1.conv2"].out_channels for i in range(1, 5)] == [256, 128, 96, 96]
    # Decoder blocks see the upsampled features with the encoder's of that level appended.
    assert [convs[f"decoder{i}.block0.conv1"].in_channels for i in range(1, 5)] == [256 + 128, 128 + 64, 96 + 32,
                                                                                     96 + 32]
    assert convs["classifier"].out_channels == 20 and convs["classifier"].bias
    blocks = [sum(1 for path in convs if path.startswith(f"{stage}.block") and path.endswith(".conv1"))
              for stage in [f"encoder{i}" for i in range(1, 5)] + [f"decoder{i}" for i in range(1, 5)]]
    assert blocks == list(networks.MINKUNET_BLOCKS[18])
    model = torch_networks.MinkUNet18(3, 20)
    described = sum(math.prod(shape) for key, shape in networks.parameter_shapes(description).items()
                    if "running" not in key)
    assert described == sum(parameter.numel() for parameter in model.parameters())


def test_map_requests_are_the_maps_the_convolutions_run_over():
    """MinkUNet18 written out by hand: per level a 3^3 submanifold map and a 2^3 stride-2 one to the next,
    1^3 maps where a block widens, and the 2^3 transposed maps back, in running order."""
    cube = lambda size: (size,) * 3  # noqa: E731
    subm, down, one = (cube(3), cube(1)), (cube(2), cube(2)), (cube(1), cube(1))
    expected = [(1, *subm), (1, *down), (2, *subm), (2, *down), (4, *subm), (4, *one), (4, *down), (8, *subm),
                (8, *one), (8, *down), (16, *subm), (16, *one)]
    expected = [MapRequest(cube(level), kernel, stride, cube(1)) for level, kernel, stride in expected]
    expected += [MapRequest(cube(level), *down, cube(1), transposed=True) for level in (16, 8, 4)]
    expected += [MapRequest(cube(2), *one, cube(1)), MapRequest(cube(2), *down, cube(1), transposed=True),
                 MapRequest(cube(1), *one, cube(1))]
    assert networks.map_requests(networks.minkunet(18)) == expected
    centerpoint = networks.map_requests(networks.centerpoint_backbone(4))
    assert [(request.tensor_stride, request.stride) for request in centerpoint] == [
        (cube(1), cube(1)), (cube(1), cube(2)), (cube(2), cube(1)), (cube(2), cube(2)), (cube(4), cube(1)),
        (cube(4), cube(2)), (cube(8), cube(1)), (cube(8), (1, 1, 2))]


def test_map_requests_of_a_padded_network_name_the_caches_its_padded_convolutions_start():
    """A padded convolution's output starts a map cache of its own: the maps past it run there."""
    requests = networks.map_requests(networks.centerpoint_backbone(4, padded=True))
    cube = lambda size: (size,) * 3  # noqa: E731
    assert [(request.cache, request.tensor_stride, request.stride, request.padding) for request in requests] == [
        (0, cube(1), cube(1), None), (0, cube(1), cube(2), cube(1)),
        (1, cube(2), cube(1), None), (1, cube(2), cube(2), cube(1)),
        (2, cube(4), cube(1), None), (2, cube(4), cube(2), cube(1)),
        (3, cube(8), cube(1), None), (3, cube(8), (1, 1, 2), cube(0))]


@pytest.mark.parametrize("description", [networks.minkunet(14, 4, 5), networks.centerpoint_backbone(4),
                                         networks.centerpoint_backbone(4, padded=True)],
                         ids=["minkunet14", "centerpoint", "padded centerpoint"])
@pytest.mark.parametrize("runner", ["core", "torch"])
def test_a_forward_runs_over_the_maps_built_up_front_and_no_other(description, runner):
    """The network builds its `map_requests` (`start_maps`: on the CPU all before its first layer); its layers
    then build none of their own, and ask for each with the very arguments of its request (found at once,
    nothing normalised again)."""
    tensor = _voxels("outdoor", 3000, 4)
    if runner == "core":
        network = InferenceNetwork(description, networks.random_weights(description), device="cpu", dtype="float32")
    else:
        model = torch_networks.SparseNetwork(description).eval()
        network = lambda core: model(cst.SparseTensor(torch.from_numpy(core.coordinates),  # noqa: E731
                                                      torch.from_numpy(core.features)))
    built, caches = [], []
    original = type(tensor.map_cache).start_maps

    def recording(cache, requests, with_reversed=False):
        underway = original(cache, requests, with_reversed)
        results = underway.results()
        caches.extend({id(c): c for c in [cache, *(result.out_map_cache for result in results)]}.values())
        built.append(sum(len(c) for c in caches))
        return underway

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(tensor.map_cache), "start_maps", recording)
        network(tensor)
    assert built == [len(networks.map_requests(description))] == [sum(len(cache) for cache in caches)]
    assert sum(len(cache._by_arguments) for cache in caches) == len(networks.map_requests(description))


def test_centerpoint_backbone_downsamples_eight_times_and_halves_the_height():
    tensor = _voxels("outdoor", 4000, 4)
    out = InferenceNetwork(networks.centerpoint_backbone(4), networks.random_weights(networks.centerpoint_backbone(4)),
                           device="cpu", dtype="float32")(tensor)
    assert out.tensor_stride == (8, 8, 16)
    assert out.num_channels == networks.CENTERPOINT_OUT_CHANNELS
    expected = np.unique(np.floor_divide(tensor.coordinates[:, 1:], [8, 8, 16]), axis=0)
    np.testing.assert_array_equal(np.unique(out.coordinates[:, 1:], axis=0), expected)


@pytest.mark.parametrize("name", sorted(DESCRIPTIONS))
@pytest.mark.parametrize("fold_batch_norm", [True, False])
def test_framework_free_inference_equals_the_torch_modules_in_float64(name, fold_batch_norm, tmp_path):
    description = DESCRIPTIONS[name]()
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(description).double()
    _randomise_batch_norms(model)
    tensor = _voxels("indoor" if "MinkUNet" in name else "outdoor", 2500, description.in_channels)
    expected = _torch_output(model, tensor, torch.float64)
    path = tmp_path / "weights.safetensors"
    torch_networks.save_weights(model, path)
    network = InferenceNetwork(description, path, device="cpu", dtype="float64", fold_batch_norm=fold_batch_norm)
    got = network(tensor.replace_features(tensor.features.astype(np.float64)))
    assert got.features.shape == expected.shape
    np.testing.assert_allclose(got.features, expected, rtol=0, atol=1e-10 * np.abs(expected).max())


def test_framework_free_float32_inference_is_within_fp32_tolerance_of_float64_torch():
    description = networks.minkunet(18, 3, NUM_CLASSES, width=0.25)
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(description).double()
    _randomise_batch_norms(model)
    tensor = _voxels("indoor", 2500, 3)
    expected = _torch_output(model, tensor, torch.float64)
    weights = {key: value.float().numpy() for key, value in model.state_dict().items()}
    got = InferenceNetwork(description, weights, device="cpu", dtype="float32")(tensor).features
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_RTOL * np.abs(expected).max())


def test_weights_round_trip_through_a_file(tmp_path):
    torch.manual_seed(0)
    model = torch_networks.MinkUNet14(3, NUM_CLASSES, width=0.25)
    _randomise_batch_norms(model)
    path = tmp_path / "minkunet14.safetensors"
    torch_networks.save_weights(model, path)
    torch.manual_seed(1)
    other = torch_networks.MinkUNet14(3, NUM_CLASSES, width=0.25)
    assert not torch.equal(other.state_dict()["stem.first_conv.weight"], model.state_dict()["stem.first_conv.weight"])
    torch_networks.load_weights_into(other, path)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    assert set(load_weights(path)) == set(model.state_dict())


def test_bfloat16_weights_round_trip_bit_exactly(tmp_path):
    model = torch_networks.MinkUNet14(3, NUM_CLASSES, width=0.25).to(torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    torch_networks.save_weights(model, path)
    assert load_weights(path)["stem.first_conv.weight"].dtype.name == "bfloat16"
    other = torch_networks.MinkUNet14(3, NUM_CLASSES, width=0.25).to(torch.bfloat16)
    torch_networks.load_weights_into(other, path)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_random_weights_are_what_the_torch_modules_would_hold():
    description = networks.minkunet(14, 3, NUM_CLASSES, width=0.25)
    weights = networks.random_weights(description, seed=3)
    assert {key: value.shape for key, value in weights.items()} == networks.parameter_shapes(description)
    model = torch_networks.SparseNetwork(description)
    model.load_state_dict({key: torch.from_numpy(value) for key, value in weights.items()}, strict=False)
    tensor = _voxels("indoor", 1500, 3)
    expected = _torch_output(model, tensor, torch.float32)
    got = InferenceNetwork(description, weights, device="cpu", dtype="float32")(tensor).features
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_RTOL * np.abs(expected).max())
    bound = 1 / math.sqrt(27 * 3)
    first = weights["stem.first_conv.weight"]
    assert np.abs(first).max() <= bound and np.abs(first).max() > 0.9 * bound


def test_weights_that_do_not_fit_are_rejected_by_name():
    description = networks.minkunet(14, 3, NUM_CLASSES, width=0.25)
    weights = networks.random_weights(description)
    missing = dict(weights)
    del missing["encoder2.block0.norm1.running_var"]
    with pytest.raises(ValueError, match=r"missing \['encoder2.block0.norm1.running_var'\]"):
        InferenceNetwork(description, missing, device="cpu")
    with pytest.raises(ValueError, match=r"unexpected \['head.weight'\]"):
        InferenceNetwork(description, {**weights, "head.weight": np.zeros(3)}, device="cpu")
    wrong = {**weights, "classifier.weight": np.zeros((1, 24, NUM_CLASSES + 1), np.float32)}
    with pytest.raises(ValueError, match="classifier.weight.*expects"):
        InferenceNetwork(description, wrong, device="cpu")
    with pytest.raises(TypeError, match="weights must be a mapping"):
        InferenceNetwork(description, [1, 2], device="cpu")


def test_inference_rejects_inputs_it_cannot_run():
    description = networks.minkunet(14, 3, NUM_CLASSES, width=0.25)
    network = InferenceNetwork(description, networks.random_weights(description), device="cpu", dtype="float32")
    tensor = _voxels("indoor", 1000, 3)
    with pytest.raises(ValueError, match="takes 3 input channels, got 4"):
        network(tensor.replace_features(np.zeros((len(tensor), 4), np.float32)))
    with pytest.raises(TypeError, match="runs in float32"):
        network(tensor.replace_features(tensor.features.astype(np.float64)))
    with pytest.raises(TypeError, match="cupysparse.SparseTensor"):
        network(tensor.features)


@pytest.mark.parametrize("arguments, message", [
    (dict(depth=17), "depth must be one of"),
    (dict(width=0), "width must be a positive number"),
    (dict(width=float("nan")), "width must be a positive number"),
    (dict(num_classes=0), "num_classes must be a positive int"),
    (dict(in_channels=2.5), "in_channels must be a positive int"),
])
def test_minkunet_arguments_are_checked(arguments, message):
    with pytest.raises(ValueError, match=message):
        networks.minkunet(**arguments)


def test_a_skip_from_other_coordinates_is_refused():
    description = networks.Network("bad", networks.Sequential("", (
        networks.SaveSkip("skip"),
        networks.Conv("down", 3, 3, 2, stride=2),
        networks.ConcatSkip("concat", "skip"),
    )), 3, 6)
    tensor = _voxels("indoor", 1000, 3)
    with pytest.raises(ValueError, match="other coordinates"):
        InferenceNetwork(description, networks.random_weights(description), device="cpu", dtype="float32")(tensor)
    model = torch_networks.SparseNetwork(description)
    with pytest.raises(ValueError, match="other coordinates"):
        _torch_output(model, tensor, torch.float32)
    x = cst.SparseTensor(torch.from_numpy(tensor.coordinates), torch.from_numpy(tensor.features))
    with pytest.raises(ValueError, match="other coordinates"):  # a training step as one autograd node too
        model.train()(x)


def test_every_parameter_of_a_minkunet_gets_a_finite_gradient():
    torch.manual_seed(0)
    model = torch_networks.MinkUNet14(3, NUM_CLASSES, width=0.25).train()
    tensor = _voxels("indoor", 1500, 3)
    x = cst.SparseTensor(torch.from_numpy(tensor.coordinates), torch.from_numpy(tensor.features))
    labels = torch.randint(0, NUM_CLASSES, (len(tensor),), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(x).features, labels).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().max() > 0, name


def test_weights_file_written_from_core_arrays_runs_the_same(tmp_path):
    description = networks.minkunet(14, 3, NUM_CLASSES, width=0.25)
    weights = networks.random_weights(description, seed=5)
    path = tmp_path / "core.safetensors"
    save_weights(path, weights)
    tensor = _voxels("indoor", 1500, 3)
    from_dict = InferenceNetwork(description, weights, device="cpu", dtype="float32")(tensor).features
    from_file = InferenceNetwork(description, str(path), device="cpu", dtype="float32")(tensor).features
    np.testing.assert_array_equal(from_file, from_dict)


def test_copies_and_pickles_of_a_network_carry_no_prefetch_and_the_original_keeps_its_own():
    import concurrent.futures
    import copy
    import io
    import threading

    from cupysparse.networks.prefetch import KernelPrefetch

    model = torch_networks.MinkUNet14(3, NUM_CLASSES, width=0.25)
    running = KernelPrefetch(concurrent.futures.Future(), threading.Event())  # what a GPU move starts
    model.prefetched = running
    copied = copy.deepcopy(model)
    assert copied.prefetched is None and model.prefetched is running
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).prefetched is None
    for key, value in model.state_dict().items():
        assert torch.equal(copied.state_dict()[key], value), key
