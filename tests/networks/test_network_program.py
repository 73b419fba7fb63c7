"""A `SparseNetwork`'s steps as one program (`adapters.torch.network_program`) against the modules' steps in float64
on the CPU: a training step as one autograd node against the modules' layer by layer through autograd and torch's
batch norm (the outputs, every gradient and every batch-norm statistic), and inference with the batch norms folded
against the modules' call. A forward hook on any module sends a step through the modules."""

import copy

import numpy as np
import pytest

from cupysparse import SparseTensor
from cupysparse.data.scenes import make_scene
from cupysparse.networks import descriptions as networks

torch = pytest.importorskip("torch")
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.adapters.torch import networks as torch_networks  # noqa: E402
from cupysparse.adapters.torch.network_program import NetworkProgram  # noqa: E402

FP64_RTOL = 1e-10
FP32_RTOL = 1e-4  # the design notes' float32 bound
PROGRAM_NODE = "_NetworkStepBackward"


def _odd_layers() -> networks.Network:
    """What the reference networks do not have: a ReLU on its own, a residual sum without a batch norm before it,
    a batch norm without a ReLU, a convolution with a bias inside the network, an identity shortcut."""
    return networks.Network("odd", networks.Sequential("", (
        networks.Conv("first", 3, 8, 3, bias=True),
        networks.ReLU("relu"),
        networks.SaveSkip("skip"),
        networks.Conv("down", 8, 8, 2, stride=2),
        networks.BatchNorm("down_norm", 8),
        networks.Residual("plain", (networks.Conv("conv", 8, 8, 3), networks.ReLU("relu"))),
        networks.Residual("normed", (networks.Conv("conv1", 8, 8, 3), networks.BatchNorm("norm1", 8),
                                     networks.Conv("conv2", 8, 8, 3), networks.BatchNorm("norm2", 8))),
        networks.Conv("up", 8, 6, 2, stride=2, transposed=True),
        networks.ConcatSkip("concat", "skip"),
        networks.Conv("classifier", 14, 4, 1, bias=True),
    )), 3, 4)


DESCRIPTIONS = {
    "MinkUNet14": lambda: networks.minkunet(14, 3, 5, width=0.25),
    "MinkUNet18": lambda: networks.minkunet(18, 3, 5, width=0.25),
    "CenterPointBackbone": lambda: networks.centerpoint_backbone(3, width=0.5),
    "CenterPointBackbone padded": lambda: networks.centerpoint_backbone(3, width=0.5, padded=True),
    "odd": _odd_layers,
}


def _input(num_voxels: int = 1500, seed: int = 0) -> cst.SparseTensor:
    scene = make_scene("indoor", num_voxels, seed=seed)
    features = np.random.default_rng(seed).standard_normal((len(scene.points), 3))
    voxels = SparseTensor.from_points(scene.points, scene.voxel_size, features=features, reduce="first")
    return cst.SparseTensor(torch.from_numpy(voxels.coordinates), torch.from_numpy(voxels.features).double()
                            .requires_grad_(True))


def _step(model, x: cst.SparseTensor):
    """(output features, its autograd node's name, input gradient, parameter gradients, state) of one step."""
    output = model(x).features
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype, device=output.device).reshape(output.shape)
    (output * weights).sum().backward()
    grads = {name: parameter.grad for name, parameter in model.named_parameters()}
    return output.detach(), output.grad_fn.name(), x.features.grad, grads, copy.deepcopy(model.state_dict())


def _assert_close(got, expected, what: str, rtol: float = FP64_RTOL) -> None:
    got, expected = got.double().cpu(), expected.double().cpu()
    scale = expected.abs().max().item() or 1.0
    difference = (got - expected).abs().max().item()
    assert difference <= rtol * scale, f"{what}: {difference:.3g} against {scale:.3g}"


@pytest.mark.parametrize("name", sorted(DESCRIPTIONS))
def test_a_training_step_as_one_node_equals_the_modules_step(name):
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(DESCRIPTIONS[name]()).double().train()
    layered = copy.deepcopy(model)
    hook = next(iter(layered.children())).register_forward_hook(lambda *arguments: None)
    for step in range(2):  # the second with the running statistics and counts the first moved
        x, x_layered = _input(seed=step), _input(seed=step)
        output, node, grad_input, grads, state = _step(model, x)
        expected, expected_node, expected_grad_input, expected_grads, expected_state = _step(layered, x_layered)
        assert node == PROGRAM_NODE and expected_node != PROGRAM_NODE
        _assert_close(output, expected, "output")
        _assert_close(grad_input, expected_grad_input, "input gradient")
        assert grads.keys() == expected_grads.keys()
        for key, grad in grads.items():
            assert grad is not None and grad.dtype == torch.float64, key
            _assert_close(grad, expected_grads[key], key)
        for key, value in state.items():
            _assert_close(value.double(), expected_state[key].double(), key)
        model.zero_grad(set_to_none=True)
        layered.zero_grad(set_to_none=True)
    hook.remove()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


@pytest.mark.parametrize("name", ["MinkUNet18", "odd"])
def test_a_training_step_keeps_of_each_voxel_only_what_it_cannot_recompute(name):
    """Between the forward and the backward, a step holds at full resolution the batch norms' inputs, the first
    convolution's input and the ReLUs' outputs: not the norms' outputs, nor a skip's concatenation, which the
    backward recomputes (the gradients equal the modules', above). The odd network's classifier also keeps its
    input, the concatenation of a skip with an upsampling convolution's output that nothing else keeps."""
    model = torch_networks.SparseNetwork(DESCRIPTIONS[name]()).double().train()
    x = _input()
    output = model(x).features
    program, step = output.grad_fn.program, output.grad_fn.step
    rows = len(x.features)
    kept = {tensor.untyped_storage().data_ptr(): tensor.shape[1] for tensor in _tensors(step.saved)
            if tensor.shape[0] == rows}
    expected = {x.features.untyped_storage().data_ptr()}
    for operation, saved in zip(program.operations, step.saved):
        kind = type(operation).__name__
        if kind == "_Norm" and saved[0].shape[0] == rows:
            expected.add(saved[0].untyped_storage().data_ptr())
        elif kind == "_ReLU" and saved.shape[0] == rows:
            expected.add(saved.untyped_storage().data_ptr())
    assert expected <= kept.keys()
    others = sorted(channels for storage, channels in kept.items() if storage not in expected)
    assert others == ([] if name == "MinkUNet18" else [14])
    recomputed = [type(operation).__name__ for operation in program.operations if getattr(operation, "recomputed",
                                                                                           False)]
    assert ("_Concat" in recomputed) == (name == "MinkUNet18")  # the odd network's skip joins a convolution's output
    output.sum().backward()
    assert not step.recomputed  # each freed after its last reader


def test_a_frozen_part_gets_no_gradient_and_the_rest_the_modules_gradients():
    torch.manual_seed(0)
    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    for parameter in model.stem.parameters():
        parameter.requires_grad_(False)
    layered = copy.deepcopy(model)
    layered.classifier.register_forward_hook(lambda *arguments: None)
    x, x_layered = _input(), _input()
    x.features.requires_grad_(False)
    x_layered.features.requires_grad_(False)
    _, node, grad_input, grads, _ = _step(model, x)
    _, _, _, expected_grads, _ = _step(layered, x_layered)
    assert node == PROGRAM_NODE and grad_input is None
    for key, grad in grads.items():
        if key.startswith("stem."):
            assert grad is None, key
        else:
            _assert_close(grad, expected_grads[key], key)


def test_a_batch_norm_with_a_bias_and_no_weight_gets_the_modules_bias_gradient():
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(_odd_layers()).double().train()
    model.down_norm.weight = None  # shifted, not scaled: its gradients are the weight's, then the bias's
    layered = copy.deepcopy(model)
    layered.first.register_forward_hook(lambda *arguments: None)
    output, node, _, grads, _ = _step(model, _input())
    expected, expected_node, _, expected_grads, _ = _step(layered, _input())
    assert node == PROGRAM_NODE and expected_node != PROGRAM_NODE
    _assert_close(output, expected, "output")
    assert "down_norm.weight" not in grads
    _assert_close(grads["down_norm.bias"], expected_grads["down_norm.bias"], "down_norm.bias")


def test_hooks_on_any_module_are_called_through_the_modules_step():
    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    called = []
    model.encoder2.block0.conv1.register_forward_hook(lambda *arguments: called.append("after"))
    model.decoder1.up_norm.register_forward_pre_hook(lambda *arguments: called.append("before"))
    output = model(_input()).features
    assert output.grad_fn.name() != PROGRAM_NODE
    assert called == ["after", "before"]


def test_replaced_parameters_get_their_gradients():
    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    model(_input()).features.sum().backward()  # compiles the program
    model.load_state_dict({key: value.clone() for key, value in model.state_dict().items()}, assign=True)
    model.zero_grad(set_to_none=True)
    output = model(_input()).features
    assert output.grad_fn.name() == PROGRAM_NODE
    output.sum().backward()
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_a_second_backward_through_the_step_is_refused_with_a_reason():
    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    loss = model(_input()).features.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="goes backward once"):
        loss.backward()


def test_a_changed_output_is_refused_by_autograd():
    model = torch_networks.CenterPointBackbone(3, width=0.5).double().train()
    output = model(_input()).features
    output.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        output.sum().backward()


def test_a_network_told_so_steps_layer_by_layer():
    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    model.one_autograd_node = False
    assert model(_input()).features.grad_fn.name() != PROGRAM_NODE
    model.one_autograd_node = True
    assert model(_input()).features.grad_fn.name() == PROGRAM_NODE


def test_a_replaced_module_is_the_one_that_runs():
    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    model(_input())  # compiles the program
    replaced = torch_networks.SparseBatchNorm(model.stem.first_norm.num_features).double()
    model.stem.first_norm = replaced
    model(_input())
    assert replaced.num_batches_tracked.item() == 1


def test_a_module_of_another_kind_sends_the_step_through_the_modules():
    class LeakyReLU(torch.nn.Module):
        def forward(self, input):
            return input.replace_feature(torch.nn.functional.leaky_relu(input.features, 0.1))

    model = torch_networks.MinkUNet14(3, 5, width=0.25).double().train()
    assert model(_input()).features.grad_fn.name() == PROGRAM_NODE
    model.stem.first_relu = LeakyReLU()
    assert model(_input()).features.grad_fn.name() != PROGRAM_NODE


def test_a_batch_norm_takes_the_training_norm_where_its_state_fits_the_features():
    norm = torch_networks.SparseBatchNorm(8).double()
    cpu = torch.device("cpu")
    assert norm.training_norm_takes(torch.float64, cpu)
    assert not norm.training_norm_takes(torch.float32, cpu)  # on the CPU, the reference runs in the state's dtype
    norm.weight.data = norm.weight.data.float()
    assert not norm.training_norm_takes(torch.float64, cpu)  # parameters of two dtypes
    norm = torch_networks.SparseBatchNorm(8, momentum=None).double()
    assert not norm.training_norm_takes(torch.float64, cpu)  # torch's cumulative average


def test_a_batch_norm_given_features_of_other_channels_is_refused_by_name():
    description = networks.Network("mismatched", networks.Sequential("", (
        networks.Conv("conv", 3, 8, 3), networks.BatchNorm("norm", 6),
    )), 3, 6)
    model = torch_networks.SparseNetwork(description).double().train()
    with pytest.raises(ValueError, match="batch norm of 6 channels got features of 8"):
        model(_input())


def _evaluated(model):
    """`model` in evaluation, its batch norms' running statistics moved off 0 and 1 (as training leaves them)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.copy_(torch.rand(module.num_features, generator=generator) - 0.5)
                module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    return model.eval()


@pytest.fixture
def inference_calls(monkeypatch):
    """The number of calls that ran through `NetworkProgram.inference`, as a one-item list."""
    calls = [0]
    original = NetworkProgram.inference

    def counted(self, input):
        calls[0] += 1
        return original(self, input)

    monkeypatch.setattr(NetworkProgram, "inference", counted)
    return calls


@pytest.mark.parametrize("name", sorted(DESCRIPTIONS))
def test_inference_through_the_program_equals_the_modules_call(name, inference_calls):
    torch.manual_seed(0)
    model = _evaluated(torch_networks.SparseNetwork(DESCRIPTIONS[name]()).double())
    layered = copy.deepcopy(model)
    next(iter(layered.children())).register_forward_hook(lambda *arguments: None)
    with torch.no_grad():
        expected = layered(_input(seed=3))
        assert inference_calls == [0]
        output = model(_input(seed=3))
    assert inference_calls == [1]
    assert torch.equal(output.coordinates, expected.coordinates)
    assert output.tensor_stride == expected.tensor_stride
    _assert_close(output.features, expected.features, "output")


def test_inference_folds_the_statistics_as_they_are_at_each_call(inference_calls):
    torch.manual_seed(0)
    model = _evaluated(torch_networks.MinkUNet14(3, 5, width=0.25).double())
    layered = copy.deepcopy(model)
    layered.classifier.register_forward_hook(lambda *arguments: None)
    with torch.no_grad():
        model(_input())
        for network in (model, layered):
            network.stem.first_norm.running_var.mul_(4)
            network.encoder1.block0.norm1.bias.add_(0.5)
        output, expected = model(_input()).features, layered(_input()).features
    assert inference_calls == [2]
    _assert_close(output, expected, "output")


def test_inference_with_gradients_or_a_training_norm_runs_through_the_modules(inference_calls):
    torch.manual_seed(0)
    model = _evaluated(torch_networks.MinkUNet14(3, 5, width=0.25).double())
    output = model(_input()).features
    assert output.grad_fn is not None  # evaluation with gradients: differentiable, through the modules
    model.stem.first_norm.train()
    tracked = model.stem.first_norm.num_batches_tracked.item()
    with torch.no_grad():
        model(_input())
    assert model.stem.first_norm.num_batches_tracked.item() == tracked + 1  # the batch's statistics, counted
    assert inference_calls == [0]


def test_inference_under_autocast_on_the_cpu_equals_the_modules_call(inference_calls):
    torch.manual_seed(0)
    model = _evaluated(torch_networks.MinkUNet14(3, 5, width=0.25))
    layered = copy.deepcopy(model)
    layered.classifier.register_forward_hook(lambda *arguments: None)
    x = _input()
    x = cst.SparseTensor(x.coordinates, x.features.detach().float())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        output, expected = model(x).features, layered(x).features
    assert inference_calls == [1]
    assert output.dtype == expected.dtype == torch.bfloat16
    _assert_close(output, expected, "output", rtol=0)


@pytest.mark.gpu
def test_a_float32_training_step_as_one_node_on_cuda_is_the_float64_modules_step_within_float32s_bound():
    """The GPU's kernels in the program (`training_norm.run_forward` and `run_backward`, the planned convolutions,
    the wgrad shares derived together from the second step on) against the modules' step in float64 on the CPU,
    over the odd layers, whose gradients are well defined: in float64, input features moved by 1e-5 of their size
    move them by 3.5e-5 of their largest values at most. A MinkUNet's are not (`test_networks_gpu.py`)."""
    torch.manual_seed(0)
    model = torch_networks.SparseNetwork(_odd_layers()).cuda().train()
    exact = copy.deepcopy(model).cpu().double()
    next(iter(exact.children())).register_forward_hook(lambda *arguments: None)  # the modules' step
    for step in range(2):
        x = _input(seed=step)
        coordinates, features = x.coordinates, x.features.detach().float()
        x_exact = cst.SparseTensor(coordinates, features.double().requires_grad_(True))
        x_gpu = cst.SparseTensor(coordinates.cuda(), features.cuda().requires_grad_(True))
        output, node, grad_input, grads, state = _step(model, x_gpu)
        expected, _, expected_grad_input, expected_grads, expected_state = _step(exact, x_exact)
        assert node == PROGRAM_NODE
        _assert_close(output, expected, "output", FP32_RTOL)
        _assert_close(grad_input, expected_grad_input, "input gradient", FP32_RTOL)
        assert grads.keys() == expected_grads.keys()
        for key, grad in grads.items():
            assert grad is not None and grad.dtype == torch.float32, key
            _assert_close(grad, expected_grads[key], key, FP32_RTOL)
        for key, value in state.items():
            _assert_close(value, expected_state[key], key, FP32_RTOL)
        model.zero_grad(set_to_none=True)
        exact.zero_grad(set_to_none=True)
