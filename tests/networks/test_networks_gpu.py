"""The reference networks on the GPU: framework-free inference (CuPy) and the PyTorch modules on CUDA
against the float64 PyTorch modules on the CPU, and the demo on the GPU.

A whole network's low-precision error is bounded like one layer's in `tolerances`, each
convolution on the longest path counted as one rounded term: 4 · eps · sqrt(depth) relative to the
largest output (fp32 uses the design notes' 1e-4).
"""

import copy
import math

import numpy as np
import pytest

from cupysparse import SparseTensor
from cupysparse.scripts import demo
from cupysparse.networks import descriptions as networks
from cupysparse.cuda.backend import to_device, to_numpy
from cupysparse.networks.inference import InferenceNetwork
from cupysparse.data.scenes import make_scene
from tolerances import EPSILON

torch = pytest.importorskip("torch")
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.adapters.torch import networks as torch_networks  # noqa: E402

pytestmark = pytest.mark.gpu

NUM_CLASSES = 9
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _bound(dtype: str, description: networks.Network) -> float:
    if dtype == "float32":
        return 1e-4
    return 4 * EPSILON[dtype] * math.sqrt(len(networks.convolutions(description)))


@pytest.fixture(scope="module")
def case():
    """(description, float64 CPU model, CPU voxels, its float64 output) with trained-looking batch norms."""
    description = networks.minkunet(18, 3, NUM_CLASSES, width=0.5)
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(description).double().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.copy_(torch.rand(module.num_features, generator=generator, dtype=torch.float64)
                                          - 0.5)
                module.running_var.copy_(torch.rand(module.num_features, generator=generator, dtype=torch.float64)
                                         + 0.5)
    scene = make_scene("indoor", 30_000, seed=0)
    features = np.random.default_rng(0).standard_normal((len(scene.points), 3)).astype(np.float32)
    voxels = SparseTensor.from_points(scene.points, scene.voxel_size, features=features, reduce="first")
    x = cst.SparseTensor(torch.from_numpy(voxels.coordinates), torch.from_numpy(voxels.features).double())
    with torch.no_grad():
        expected = model(x).features.numpy()
    return description, model, voxels, expected


def _rounded_input(voxels: SparseTensor, dtype: str) -> SparseTensor:
    features = to_device(voxels.features, "cuda").astype(dtype)
    return SparseTensor(to_device(voxels.coordinates, "cuda"), features, validate=False)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_framework_free_inference_on_the_gpu_matches_float64(case, dtype):
    description, model, voxels, expected = case
    weights = {key: value.numpy() for key, value in model.state_dict().items()}
    network = InferenceNetwork(description, weights, device="cuda", dtype=dtype)
    got = to_numpy(network(_rounded_input(voxels, dtype)).features).astype(np.float64)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=_bound(dtype, description) * scale)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_modules_on_cuda_match_float64(case, dtype):
    description, model, voxels, expected = case
    cuda_model = torch_networks.SparseNetwork(description).cuda().to(TORCH_DTYPES[dtype]).eval()
    cuda_model.load_state_dict(model.state_dict())
    x = cst.SparseTensor(torch.from_numpy(voxels.coordinates).cuda(),
                         torch.from_numpy(voxels.features).cuda().to(TORCH_DTYPES[dtype]))
    with torch.no_grad():
        got = cuda_model(x).features.double().cpu().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=_bound(dtype, description) * np.abs(expected).max())


def test_a_mixed_precision_training_step_on_cuda_gives_finite_gradients_everywhere(case):
    description, model, voxels, _ = case
    cuda_model = torch_networks.SparseNetwork(description).cuda().train()
    x = cst.SparseTensor(torch.from_numpy(voxels.coordinates).cuda(), torch.from_numpy(voxels.features).cuda())
    labels = torch.randint(0, NUM_CLASSES, (len(voxels),), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        logits = cuda_model(x).features
    torch.nn.functional.cross_entropy(logits.float(), labels).backward()
    for name, parameter in cuda_model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_demo_runs_and_trains_on_the_gpu(tmp_path, capsys):
    plot = tmp_path / "scene.png"
    arguments = ["--device", "cuda", "--num-voxels", "30000", "--train-steps", "3", "--repeats", "2",
                 "--plot", str(plot)]
    assert demo.main(arguments) == 0
    output = capsys.readouterr().out
    assert "fp16" in output and "all 50 convolutions" in output
    assert "(falling)" in output
    assert plot.stat().st_size > 0



def _training_step(network, coordinates, features, autocast: bool):
    """(autograd node name, output, parameter gradients, state) of one step, each in float64 on the CPU."""
    with torch.autocast(features.device.type, dtype=torch.float16, enabled=autocast):
        output = network(cst.SparseTensor(coordinates, features, validate=False)).features
    output_dtype = torch.promote_types(output.dtype, torch.float32)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = weights.to(device=output.device, dtype=output_dtype)
    (output.to(output_dtype) * weights).sum().backward()
    return (output.grad_fn.name(), output.detach().double().cpu(),
            {name: parameter.grad.double().cpu() for name, parameter in network.named_parameters()},
            {name: value.double().cpu() for name, value in network.state_dict().items()})


def _relative(got: torch.Tensor, wanted: torch.Tensor) -> float:
    return (got - wanted).abs().max().item() / (wanted.abs().max().item() or 1.0)


def _layer_by_layer(model):
    model.stem.register_forward_hook(lambda *arguments: None)  # any hook sends a step through the modules
    return model


def _check_one_node_step(description, voxels, precision: str, device: str) -> None:
    """The one-node step (`adapters.torch.network_program`) against the modules' step on `device`: the output and
    every batch-norm statistic within the dtype's network bound, the gradients finite. Their values are checked
    where they are well defined: a MinkUNet's gradients at initialisation are not. In float64 on the CPU, input
    features moved by 1e-5 of their size move its gradients by up to 15% of their largest values (a median of
    1.7-2.5%), and float32 rounding moves them as far: two float32 steps of the modules themselves fall 0.1% or 1.7%
    (median) from float64, by where their rounding lands. `test_network_program.py` compares the gradients exactly
    in float64 on the CPU and within float32's bound on the GPU, over layers whose gradients are well defined."""
    dtype = torch.float32 if precision == "autocast" else TORCH_DTYPES[precision]
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(description).to(device=device, dtype=dtype).train()
    layered = _layer_by_layer(copy.deepcopy(model))
    coordinates = torch.from_numpy(voxels.coordinates).to(device)
    features = torch.from_numpy(voxels.features).to(device=device, dtype=dtype)
    autocast = precision == "autocast"
    node, output, grads, state = _training_step(model, coordinates, features, autocast)
    layered_node, expected, expected_grads, expected_state = _training_step(layered, coordinates, features, autocast)
    assert node == "_NetworkStepBackward" and layered_node != node
    bound = _bound("float16" if autocast else precision, description)
    assert _relative(output, expected) <= bound
    for name, value in state.items():
        assert _relative(value, expected_state[name]) <= bound, name
    assert grads.keys() == expected_grads.keys()
    assert all(torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16", "autocast"])
def test_a_training_step_as_one_node_on_cuda_equals_the_modules_step(case, precision):
    description, _, voxels, _ = case
    _check_one_node_step(description, voxels, precision, "cuda")


@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16", "autocast"])
def test_inference_through_the_program_on_cuda_equals_the_modules_call(case, precision):
    """The program's inference (`adapters.torch.network_program`) launches the kernels the modules' fused path does,
    with the same epilogues: the same values, bit for bit."""
    description, model, voxels, _ = case
    dtype = torch.float32 if precision == "autocast" else TORCH_DTYPES[precision]
    cuda_model = torch_networks.SparseNetwork(description).cuda().to(dtype).eval()
    cuda_model.load_state_dict(model.state_dict())
    layered = _layer_by_layer(copy.deepcopy(cuda_model))
    coordinates = torch.from_numpy(voxels.coordinates).cuda()
    features = torch.from_numpy(voxels.features).cuda().to(dtype)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=precision == "autocast"):
        x = cst.SparseTensor(coordinates, features, validate=False)
        assert cuda_model._network_program().runs_inference(x)
        output = cuda_model(x)
        expected = layered(cst.SparseTensor(coordinates, features, validate=False))
    assert output.features.dtype == expected.features.dtype
    assert torch.equal(output.coordinates, expected.coordinates)
    assert torch.equal(output.features, expected.features)
