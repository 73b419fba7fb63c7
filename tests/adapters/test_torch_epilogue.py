"""The torch adapter's inference epilogue: `SparseBatchNorm` in evaluation, alone and fused with the
ReLU or residual sum after it in the networks, against torch's own `BatchNorm1d` (evaluation) and
ReLU; training and evaluation with gradients keep torch's path and give gradients."""

import numpy as np
import pytest

from cupysparse.networks import descriptions as networks
from cupysparse.cuda.backend import gpu_available
from tolerances import EPSILON

torch = pytest.importorskip("torch")
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.functional import epilogue as core_epilogue  # noqa: E402
from cupysparse.functional import execution  # noqa: E402
from cupysparse.adapters.torch import pointwise as torch_pointwise  # noqa: E402
from cupysparse.adapters.torch import networks as torch_networks  # noqa: E402

CHANNELS = 24
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def coordinates(num_per_item=150, seed=0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    items = []
    for b in range(2):
        unique = np.unique(rng.integers(-6, 6, (num_per_item, 3)), axis=0)
        items.append(np.concatenate([np.full((len(unique), 1), b), unique], axis=1))
    return torch.from_numpy(np.concatenate(items).astype(np.int32))


def trained_looking(norm, seed: int = 1):
    """`norm` with statistics and parameters away from the identity, so a wrong formula shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor, low, high in ((norm.running_mean, -0.5, 0.5), (norm.running_var, 0.2, 2.0),
                                  (norm.weight, -1.5, 1.5), (norm.bias, -0.3, 0.3)):
            tensor.copy_(torch.rand(tensor.shape, generator=generator, dtype=torch.float64) * (high - low) + low)
    return norm


def torch_reference(norm, features, residual, relu: bool):
    """torch's BatchNorm1d in evaluation (float64, from the same rounded values, on the features'
    device), then the sum and ReLU; and the size of the terms an implementation adds, `|x · s| +
    |mean · s| + |bias| + |residual|` with `s = weight / sqrt(var + eps)`, for the bound where they
    cancel (x close to the mean)."""
    reference = torch.nn.BatchNorm1d(norm.num_features, eps=norm.eps).double().eval().to(features.device)
    reference.load_state_dict({name: value.double() for name, value in norm.state_dict().items()})
    with torch.no_grad():
        wide = features.double()
        value = reference(wide)
        scale = reference.weight / torch.sqrt(reference.running_var + reference.eps)
        magnitude = (wide * scale).abs() + (reference.running_mean * scale).abs() + reference.bias.abs()
        if residual is not None:
            value = value + residual.double()
            magnitude = magnitude + residual.double().abs()
        return (torch.relu(value) if relu else value), magnitude


def assert_within_rounding(got, expected, magnitude, dtype) -> None:
    """Computed in fp32 (fp64 for fp64) and rounded once to `dtype`."""
    eps = EPSILON[str(dtype).removeprefix("torch.")]
    error = (got.double().cpu() - expected.cpu()).abs()
    bound = eps * expected.cpu().abs() + eps * magnitude.cpu()
    assert (error <= bound).all(), f"largest excess {(error - bound).max().item():.3g} ({dtype})"


def norm_case(dtype, parameter_dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    coords = coordinates(seed=seed)
    features = (torch.randn(len(coords), CHANNELS, generator=generator, dtype=torch.float64) * 2 + 0.5).to(dtype)
    residual = torch.randn(len(coords), CHANNELS, generator=generator, dtype=torch.float64).to(dtype)
    norm = trained_looking(cst.SparseBatchNorm(CHANNELS)).to(device, parameter_dtype).eval()
    x = cst.SparseTensor(coords.to(device), features.to(device))
    return norm, x, residual.to(device)


@pytest.mark.parametrize("relu, residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_evaluation_equals_torch_batch_norm_and_relu_on_the_cpu(dtype, relu, residual):
    norm, x, added = norm_case(DTYPES[dtype], DTYPES[dtype])
    added = added if residual else None
    with torch.no_grad():
        assert norm.runs_inference_epilogue(x.features, added)
        got = norm.inference_epilogue(x, added, relu=relu).features if relu or residual else norm(x).features
    expected, magnitude = torch_reference(norm, x.features, added, relu)
    assert got.dtype == DTYPES[dtype] and got.shape == x.features.shape
    assert_within_rounding(got, expected, magnitude, DTYPES[dtype])


def test_the_next_call_sees_statistics_updated_in_place():
    norm, x, _ = norm_case(torch.float32, torch.float32)
    with torch.no_grad():
        for _ in range(2):
            expected, magnitude = torch_reference(norm, x.features, None, False)
            assert_within_rounding(norm(x).features, expected, magnitude, torch.float32)
            norm.running_var.mul_(3.0)
            norm.bias.add_(1.0)


def test_with_gradients_wanted_or_in_training_torchs_batch_norm_runs_and_differentiates():
    norm, x, _ = norm_case(torch.float64, torch.float64)
    features = x.features.clone().requires_grad_()
    assert not norm.runs_inference_epilogue(features)
    out = norm(x.replace_feature(features)).features
    expected, _ = torch_reference(norm, x.features, None, False)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    assert features.grad is not None and norm.weight.grad is not None and norm.bias.grad is not None
    frozen = norm_case(torch.float64, torch.float64)[0].requires_grad_(False)
    assert frozen.runs_inference_epilogue(x.features)  # nothing to differentiate, even with grad mode on
    assert not frozen.train().runs_inference_epilogue(x.features)


def test_a_residual_of_another_dtype_is_left_to_torchs_promoting_sum():
    norm, x, added = norm_case(torch.float32, torch.float32)
    with torch.no_grad():
        assert norm.runs_inference_epilogue(x.features, added)
        assert not norm.runs_inference_epilogue(x.features, added.double())


def counted_epilogues(monkeypatch) -> list:
    """The (relu, residual given) of each epilogue the modules run, recorded as they run."""
    calls = []
    original = torch_pointwise.batch_norm_epilogue

    def recording(features, running_mean, running_var, weight, bias, eps, residual=None, relu=False):
        calls.append((relu, residual is not None))
        return original(features, running_mean, running_var, weight, bias, eps, residual, relu)

    monkeypatch.setattr(torch_pointwise, "batch_norm_epilogue", recording)
    return calls


def relu_calls(model) -> list:
    calls = []
    for module in model.modules():
        if isinstance(module, cst.SparseReLU):
            module.register_forward_hook(lambda *args: calls.append(1))
    return calls


def minkunet18(dtype=torch.float64, device="cpu"):
    torch.manual_seed(0)
    model = torch_networks.MinkUNet18(3, 5, width=0.25)
    norms = [module for module in model.modules() if isinstance(module, cst.SparseBatchNorm)]
    for seed, norm in enumerate(norms):
        trained_looking(norm, seed)
    return model.to(device, dtype).eval()


def test_a_minkunet_in_inference_fuses_every_norm_with_its_relu_or_residual_and_equals_torchs_path(monkeypatch):
    """The stem's, down- and up-sampling norms and each block's first take their ReLU, each block's
    last its residual sum and ReLU, the shortcuts' norms nothing; the result equals the same model
    through torch's batch norm, sum and ReLU (evaluation with gradients), in float64."""
    model = minkunet18()
    coords = coordinates(num_per_item=600)
    x = cst.SparseTensor(coords, torch.randn(len(coords), 3, dtype=torch.float64))
    calls, relus = counted_epilogues(monkeypatch), relu_calls(model)
    with torch.no_grad():
        fused = model(x).features
    description = networks.minkunet(18, 3, 5, width=0.25)
    blocks = sum(isinstance(layer, networks.Residual) for _, layer in networks.walk(description.root))
    shortcuts = sum(layer.shortcut is not None for _, layer in networks.walk(description.root)
                    if isinstance(layer, networks.Residual))
    norm_relus = sum(isinstance(layer, networks.ReLU) for _, layer in networks.walk(description.root))
    assert calls.count((True, True)) == blocks and calls.count((False, False)) == shortcuts
    assert calls.count((True, False)) == norm_relus and len(calls) == norm_relus + blocks + shortcuts
    assert relus == []

    calls.clear()
    x_with_gradient = x.replace_feature(x.features.clone().requires_grad_())
    reference = model(x_with_gradient).features
    assert calls == [] and len(relus) == norm_relus
    torch.testing.assert_close(fused, reference.detach(), rtol=1e-12, atol=1e-12 * reference.abs().max().item())
    reference.square().sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_a_minkunet_in_training_runs_torchs_batch_norm_and_relu_modules(monkeypatch):
    model = minkunet18().train()
    coords = coordinates(num_per_item=300)
    x = cst.SparseTensor(coords, torch.randn(len(coords), 3, dtype=torch.float64))
    calls, relus = counted_epilogues(monkeypatch), relu_calls(model)
    model(x).features.sum().backward()
    assert calls == [] and relus
    assert all(module.num_batches_tracked.item() == 1 for module in model.modules()
               if isinstance(module, cst.SparseBatchNorm))


def gpu_test(test):
    condition = not (gpu_available() and torch.cuda.is_available())
    return pytest.mark.gpu(pytest.mark.skipif(condition, reason="needs a CUDA GPU for torch")(test))


@gpu_test
@pytest.mark.parametrize("relu, residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype, parameter_dtype", [("float32", "float32"), ("float16", "float16"),
                                                    ("float16", "float32"), ("bfloat16", "bfloat16"),
                                                    ("bfloat16", "float32"), ("float64", "float64")])
def test_evaluation_on_cuda_equals_torch_batch_norm_and_relu(dtype, parameter_dtype, relu, residual, monkeypatch):
    """On CUDA the kernel runs from the adapter (on device addresses) wherever it takes the dtypes."""
    launches = []
    launch = core_epilogue.launch
    monkeypatch.setattr(core_epilogue, "launch", lambda *args: launches.append(1) or launch(*args))
    norm, x, added = norm_case(DTYPES[dtype], DTYPES[parameter_dtype], "cuda")
    added = added if residual else None
    with torch.no_grad():
        got = norm.inference_epilogue(x, added, relu=relu).features
    expected, magnitude = torch_reference(norm, x.features, added, relu)
    assert got.dtype == DTYPES[dtype] and got.is_cuda
    assert_within_rounding(got, expected, magnitude, DTYPES[dtype])
    assert len(launches) == (0 if dtype == "float64" else 1)


def counted_fusions(monkeypatch) -> list:
    """Whether each `execution.fused_forward` the convolutions try fused its epilogue, as they run."""
    fusions = []
    fused_forward = execution.fused_forward

    def recording(*args):
        out = fused_forward(*args)
        fusions.append(out is not None)
        return out

    monkeypatch.setattr(execution, "fused_forward", recording)
    return fusions


@gpu_test
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_minkunet_in_inference_on_cuda_applies_each_norm_once(dtype, monkeypatch):
    """Every norm follows a convolution: it is that convolution's epilogue where the layer's plan fuses
    one (the tensor-core GEMMs, which 16-bit layers run), else one launch of its own from the adapter;
    none falls back to the core's array path."""
    model = minkunet18(DTYPES[dtype], "cuda")
    if model.prefetched is not None:
        model.prefetched.result(timeout=300)  # its rehearsal launches the epilogues too, on its own thread
    launches = []
    launch = core_epilogue.launch
    monkeypatch.setattr(core_epilogue, "launch", lambda *args: launches.append(1) or launch(*args))
    fusions = counted_fusions(monkeypatch)
    coords = coordinates(num_per_item=600)
    x = cst.SparseTensor(coords.cuda(), torch.randn(len(coords), 3, device="cuda", dtype=DTYPES[dtype]))
    with torch.no_grad():
        out = model(x).features
    norms = sum(isinstance(module, cst.SparseBatchNorm) for module in model.modules())
    assert len(fusions) == norms and len(launches) + sum(fusions) == norms
    assert out.dtype == DTYPES[dtype] and torch.isfinite(out).all()
    if dtype != "float32":
        assert sum(fusions) > 0


@gpu_test
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_minkunet_with_norms_in_the_convolutions_epilogues_equals_one_with_norms_of_their_own(dtype, monkeypatch):
    """The same model and input with and without the fusion. The two differ by roundings only: the
    fused path rounds a layer's output to the dtype once, the other also the convolution's result before
    the norm, so the relative difference stays within a few of the dtype's epsilons per layer."""
    model = minkunet18(DTYPES[dtype], "cuda")
    if model.prefetched is not None:
        model.prefetched.result(timeout=300)
    coords = coordinates(num_per_item=600)
    x = cst.SparseTensor(coords.cuda(), torch.randn(len(coords), 3, device="cuda", dtype=DTYPES[dtype]))
    fusions = counted_fusions(monkeypatch)
    with torch.no_grad():
        fused = model(x).features.double()
    assert any(fusions)
    monkeypatch.setattr(cst.SparseBatchNorm, "folds_into_convolution", lambda self: False)
    fusions.clear()
    with torch.no_grad():
        separate = model(x).features.double()
    assert fusions == []
    norms = sum(isinstance(module, cst.SparseBatchNorm) for module in model.modules())
    relative = (fused - separate).norm() / separate.norm()
    assert relative <= 2 * norms * EPSILON[dtype], relative


@gpu_test
def test_a_forward_hook_keeps_its_layer_out_of_the_fusion(monkeypatch):
    """A hooked convolution runs as a module, so its hook sees it; the other layers still fuse."""
    model = minkunet18(torch.float16, "cuda")
    if model.prefetched is not None:
        model.prefetched.result(timeout=300)
    first = next(module for module in model.modules() if isinstance(module, cst.SpatiallySparseConv))
    seen = []
    first.register_forward_hook(lambda module, inputs, output: seen.append(output.features.shape))
    fusions = counted_fusions(monkeypatch)
    coords = coordinates(num_per_item=600)
    x = cst.SparseTensor(coords.cuda(), torch.randn(len(coords), 3, device="cuda", dtype=torch.float16))
    with torch.no_grad():
        model(x)
    assert len(seen) == 1 and any(fusions)


def training_reference(norm, features, residual, relu: bool, grad_out):
    """torch's batch norm in training, then the sum and ReLU, differentiated by autograd in float64 from
    the same rounded values: (out, grads of features, weight, bias and residual, running mean and var)."""
    reference = torch.nn.BatchNorm1d(norm.num_features, eps=norm.eps, momentum=norm.momentum).double()
    reference = reference.to(features.device).train()
    reference.load_state_dict({name: value.double() for name, value in norm.state_dict().items()})
    wide = features.detach().double().requires_grad_()
    added = None if residual is None else residual.detach().double().requires_grad_()
    value = reference(wide)
    if added is not None:
        value = value + added
    if relu:
        value = torch.relu(value)
    value.backward(grad_out.double())
    return (value.detach(), wide.grad, reference.weight.grad, reference.bias.grad,
            None if added is None else added.grad, reference.running_mean, reference.running_var)


@gpu_test
@pytest.mark.parametrize("relu, residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype, parameter_dtype", [("float32", "float32"), ("float16", "float32"),
                                                    ("bfloat16", "bfloat16")])
def test_training_on_cuda_equals_torch_batch_norm_relu_and_sum(dtype, parameter_dtype, relu, residual):
    """In training the core's two passes (forward and backward) stand in for torch's batch norm, sum and
    ReLU: the output, every gradient and the running statistics within the dtype's rounding of torch's
    in float64."""
    norm, x, added = norm_case(DTYPES[dtype], DTYPES[parameter_dtype], "cuda")
    norm.train()
    added = added.requires_grad_() if residual else None
    features = x.features.clone().requires_grad_()
    assert norm.runs_training_norm(features, added)
    grad_out = torch.randn(features.shape, generator=torch.Generator().manual_seed(4)).to("cuda", features.dtype)
    expected = training_reference(norm, features, added, relu, grad_out)
    out = norm.training_norm(x.replace_feature(features), added, relu=relu).features
    out.backward(grad_out)
    got = (out, features.grad, norm.weight.grad, norm.bias.grad, None if added is None else added.grad,
           norm.running_mean, norm.running_var)
    eps = EPSILON[dtype]
    for name, value, wanted in zip(("out", "grad_features", "grad_weight", "grad_bias", "grad_residual",
                                    "running_mean", "running_var"), got, expected):
        if wanted is None:
            continue
        tolerance = EPSILON[parameter_dtype] if name.startswith(("running", "grad_weight", "grad_bias")) else eps
        scale = wanted.abs().max().item()
        torch.testing.assert_close(value.double(), wanted, rtol=8 * tolerance, atol=8 * tolerance * scale,
                                   msg=lambda message, name=name: f"{name}: {message}")
    assert norm.num_batches_tracked.item() == 1


@gpu_test
def test_a_minkunet_in_training_on_cuda_fuses_its_norms_and_equals_torchs_modules(monkeypatch):
    """Every norm of a MinkUNet stepping layer by layer in training on CUDA runs the core's training norm (with
    its ReLU or its block's residual sum and ReLU); outputs, gradients, running statistics and counts of
    batches equal the same model's through torch's modules. (The step as one autograd node, which runs the same
    norms, is compared with this one in tests/networks.)"""
    coords = coordinates(num_per_item=600)
    features = torch.randn(len(coords), 3, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    fused, unfused = (minkunet18(torch.float32, "cuda").train() for _ in range(2))
    fused.one_autograd_node = unfused.one_autograd_node = False
    calls = []
    apply = torch_pointwise._TrainingNorm.apply
    monkeypatch.setattr(torch_pointwise._TrainingNorm, "apply", lambda *args: calls.append(1) or apply(*args))
    results = []
    for model, allowed in ((fused, True), (unfused, False)):
        with pytest.MonkeyPatch.context() as patch:
            if not allowed:
                patch.setattr(cst.SparseBatchNorm, "runs_training_norm", lambda *args: False)
            out = model(cst.SparseTensor(coords.cuda(), features.cuda())).features
            out.square().sum().backward()
        gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
        results.append((out.detach(), gradients | dict(model.named_buffers())))
    norms = [module for module in fused.modules() if isinstance(module, cst.SparseBatchNorm)]
    assert len(calls) == len(norms)
    (out, values), (expected_out, expected_values) = results
    assert all(module.num_batches_tracked.item() == 1 for module in norms)
    torch.testing.assert_close(out, expected_out, rtol=1e-3, atol=1e-3 * expected_out.abs().max().item())
    for name, value in values.items():
        expected = expected_values[name]
        torch.testing.assert_close(value, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item(),
                                   msg=lambda message, name=name: f"{name}: {message}")
