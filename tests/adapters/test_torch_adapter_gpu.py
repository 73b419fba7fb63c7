"""The PyTorch adapter on CUDA tensors: every algorithm and dtype against the fp64 core reference,
torch.compile, CUDA-graph capture and replay, and a second stream."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupysparse  # noqa: E402
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.adapters.torch import bridge  # noqa: E402
from cupysparse.adapters.torch import convolution as torch_convolution  # noqa: E402
from cupysparse.settings import ALGORITHM_MODES  # noqa: E402
from cupysparse.functional import convolution as functional  # noqa: E402
from cupysparse.functional.convolution import conv_forward  # noqa: E402
from cupysparse.algorithms import CONV, DEPTHWISE, ConvProblem, registered  # noqa: E402
from cupysparse.cuda.backend import cupy_module, gpu_available  # noqa: E402
from cupysparse.tuning import tuner as tuner_module  # noqa: E402
from cupysparse.tuning.tuner import size_bucket  # noqa: E402
import gpu_cases  # noqa: E402
from tolerances import assert_close  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (gpu_available() and torch.cuda.is_available()), reason="needs a CUDA GPU for torch"),
]

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def coordinates(seed=0) -> np.ndarray:
    return gpu_cases.coordinates(seed, side=14, density=0.3)


def algorithm_cases(kind=CONV):
    capability = int(cupy_module().cuda.Device().compute_capability) if gpu_available() else 0
    cases = []
    for name, algorithm in registered(kind).items():
        for dtype in TORCH_DTYPES:
            problem = ConvProblem(100, 100, 16, 16, 27, np.dtype(cupysparse.cuda.dtypes.as_feature_dtype(dtype)), "cuda",
                                  capability)
            if algorithm.supports(problem):
                cases.append(pytest.param(name, dtype, id=f"{name}-{dtype}"))
    return cases


@pytest.mark.parametrize("stride", [1, 2], ids=["subm", "strided"])
@pytest.mark.parametrize("name, dtype", algorithm_cases())
def test_module_output_and_gradients_equal_the_fp64_reference(name, dtype, stride):
    coords = coordinates()
    rng = np.random.default_rng(1)
    c_in, c_out, kernel = 19, 34, 3
    x = rng.standard_normal((len(coords), c_in)).astype(np.float32)
    w = (rng.standard_normal((27, c_in, c_out)) / np.sqrt(c_in)).astype(np.float32)
    torch_dtype = TORCH_DTYPES[dtype]
    features = torch.from_numpy(x).to("cuda", torch_dtype).requires_grad_()
    conv = cst.SparseConv3d(c_in, c_out, kernel, stride=stride, bias=False, fwd_algo=name, bwd_algo=name).cuda()
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(w).to(torch_dtype))
    conv = conv.to(torch_dtype)
    out = conv(cst.SparseTensor(torch.from_numpy(coords).cuda(), features))
    dy = torch.from_numpy(rng.standard_normal(tuple(out.features.shape)).astype(np.float32)).to("cuda", torch_dtype)
    out.features.backward(dy)

    # fp64 core reference from the same rounded inputs, on the CPU
    x64 = features.detach().double().cpu().numpy()
    w64 = conv.weight.detach().double().cpu().numpy()
    dy64 = dy.double().cpu().numpy()
    core = cupysparse.SparseTensor(coords, x64)
    expected = cupysparse.spatially_sparse_conv(core, w64, kernel, stride=stride)
    grads = cupysparse.spatially_sparse_conv_backward(dy64, core, w64, kernel, stride=stride)
    np.testing.assert_array_equal(out.coordinates.cpu().numpy(), expected.coordinates)
    numpy_dtype = np.dtype(cupysparse.cuda.dtypes.as_feature_dtype(dtype))
    terms = 27 * c_in
    assert_close(out.features.detach().double().cpu().numpy(), expected.features, numpy_dtype, terms, x64, w64,
                 f"{name} forward")
    assert_close(features.grad.double().cpu().numpy(), grads.input, numpy_dtype, 27 * c_out, dy64, w64,
                 f"{name} dgrad")
    assert_close(conv.weight.grad.double().cpu().numpy(), grads.weight, numpy_dtype, len(coords), x64, dy64,
                 f"{name} wgrad")


@pytest.mark.parametrize("name, dtype", algorithm_cases(DEPTHWISE))
def test_depthwise_module_output_and_gradients_equal_the_fp64_reference(name, dtype):
    coords = coordinates(seed=2)
    rng = np.random.default_rng(3)
    channels = 37
    torch_dtype = TORCH_DTYPES[dtype]
    features = torch.from_numpy(rng.standard_normal((len(coords), channels)).astype(np.float32))
    features = features.to("cuda", torch_dtype).requires_grad_()
    conv = cst.SparseDepthwiseConv(channels, 3, bias=False, fwd_algo=name, bwd_algo=name).cuda().to(torch_dtype)
    out = conv(cst.SparseTensor(torch.from_numpy(coords).cuda(), features))
    dy = torch.from_numpy(rng.standard_normal(tuple(out.features.shape)).astype(np.float32)).to("cuda", torch_dtype)
    out.features.backward(dy)

    x64 = features.detach().double().cpu().numpy()
    w64 = conv.weight.detach().double().cpu().numpy()
    dy64 = dy.double().cpu().numpy()
    kernel_map = cupysparse.SparseTensor(coords, x64).kernel_map(3).kernel_map
    expected = cupysparse.spatially_sparse_depthwise_conv(x64, w64, kernel_map, kernel_map.num_out)
    grad_input, grad_weight = cupysparse.spatially_sparse_depthwise_conv_backward(dy64, x64, w64, kernel_map)
    numpy_dtype = np.dtype(cupysparse.cuda.dtypes.as_feature_dtype(dtype))
    assert_close(out.features.detach().double().cpu().numpy(), expected, numpy_dtype, 27, x64, w64,
                 f"depthwise {name} forward")
    assert_close(features.grad.double().cpu().numpy(), grad_input, numpy_dtype, 27, dy64, w64,
                 f"depthwise {name} dgrad")
    assert_close(conv.weight.grad.double().cpu().numpy(), grad_weight, numpy_dtype, len(coords), x64, dy64,
                 f"depthwise {name} wgrad")


def two_layer_inputs(dtype=torch.float16):
    torch.manual_seed(0)
    x = cst.SparseTensor(torch.from_numpy(coordinates()).cuda(),
                         torch.randn(len(coordinates()), 16, device="cuda", dtype=dtype))
    first = cst.SubMConv3d(16, 32, 3).cuda().to(dtype)
    second = cst.SubMConv3d(32, 16, 3).cuda().to(dtype)
    kernel_map = x.kernel_map(3).kernel_map.derive_formats()
    return x, first, second, torch_convolution.pair_table(kernel_map)


def test_compiled_two_layer_block_matches_eager_without_graph_breaks():
    x, first, second, table = two_layer_inputs()

    def block(features, w1, w2):
        hidden = torch.relu(torch_convolution.convolution(features, w1, table, "", ""))
        return torch_convolution.convolution(hidden, w2, table, "", "")

    args = (x.features, first.weight, second.weight)
    eager = block(*args)
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(*args), eager, rtol=0, atol=0)


# fp16 runs the tensor-core algorithm through its launch plans, fp32 the core's array calls.
PLANNED_AND_NOT = pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])


def graph_cases():
    """(torch dtype, algorithm) for every algorithm the GPU runs in fp16 and fp32."""
    cases = []
    for case in algorithm_cases():
        name, dtype = case.values
        if dtype in ("float16", "float32"):
            cases.append(pytest.param(TORCH_DTYPES[dtype], name, id=f"{name}-{dtype}"))
    return cases


@pytest.mark.pooled_memory  # capture allocates from torch's caching allocator
@pytest.mark.parametrize("dtype, name", graph_cases())
def test_cuda_graph_capture_and_replay_of_a_training_step(dtype, name):
    """Replays equal the eager step bitwise; an algorithm capture cannot record (explicit GEMMs are
    cuBLAS calls through CuPy), asked for by name, is refused with the ones it can."""
    x, first, second, table = two_layer_inputs(dtype)
    static_features = x.features.clone().requires_grad_()
    params = (first.weight, second.weight)

    def step(features):
        hidden = torch.relu(torch_convolution.convolution(features, params[0], table, name, name))
        loss = torch_convolution.convolution(hidden, params[1], table, name, name).square().mean()
        return loss, torch.autograd.grad(loss, (features, *params))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # tunes, compiles and warms the allocator outside the capture
            step(static_features)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if not registered()[name].capturable:
        with pytest.raises(RuntimeError, match="capture cannot record"), torch.cuda.graph(graph):
            step(static_features)
        return
    with torch.cuda.graph(graph):
        static_loss, static_grads = step(static_features)
    new_features = torch.randn_like(static_features)
    with torch.no_grad():
        static_features.copy_(new_features)
    graph.replay()
    torch.cuda.synchronize()
    loss, expected = step(new_features.clone().requires_grad_())
    torch.testing.assert_close(static_loss, loss, rtol=0, atol=0)
    for got, want in zip(static_grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@PLANNED_AND_NOT
def test_a_second_stream_is_respected(dtype):
    x, first, _, _ = two_layer_inputs(dtype)
    expected = first(x).features
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy: reading its result early would be wrong
        features = x.features * 2  # made on the side stream
        out = first(x.replace_feature(features)).features
    torch.cuda.current_stream().wait_stream(side)
    expected_doubled = first(x.replace_feature(x.features * 2)).features
    torch.testing.assert_close(out, expected_doubled, rtol=0, atol=0)
    assert not torch.equal(out, expected)


@pytest.mark.pooled_memory  # reads the pools' statistics
@PLANNED_AND_NOT
def test_cupy_allocations_come_from_torchs_pool(dtype):
    x, first, _, _ = two_layer_inputs(dtype)
    first(x).features.sum().backward()  # tuned and compiled
    torch.cuda.synchronize()
    cupy_pool = cupy_module().get_default_memory_pool()
    before = cupy_pool.total_bytes()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    first(x).features.sum().backward()
    assert cupy_pool.total_bytes() == before
    assert torch.cuda.max_memory_allocated() > baseline


def test_a_changed_algorithm_variable_takes_effect_on_a_planned_layer(monkeypatch):
    """The layer signature keeps its selection and plans; changing the environment variable behind
    fwd_algo=None must still switch the algorithm, as it does for the core."""
    x, first, _, table = two_layer_inputs(torch.float16)
    kernel_map = torch_convolution._kernel_map(table)
    core_features, core_weight = bridge.to_core(x.features), bridge.to_core(first.weight.detach())
    variable = ALGORITHM_MODES[(CONV, "forward")].name
    for name in ("wmma_implicit_gemm", "implicit_gemm", "wmma_implicit_gemm"):
        monkeypatch.setenv(variable, name)
        with torch.no_grad():
            out = torch_convolution.convolution(x.features, first.weight, table, "", "")
        expected = conv_forward(core_features, core_weight, kernel_map, name)
        torch.testing.assert_close(out, bridge.from_core(expected), rtol=0, atol=0)


def test_a_new_scene_runs_the_plans_of_the_first_without_selecting_again(monkeypatch):
    """The second scene's maps are new, its sizes in the same buckets: the tuner answers from its memory
    (nothing looked up or measured), and the plans give the core's results over the second's maps, bitwise."""
    scenes = [coordinates(seed=seed) for seed in (5, 6)]
    assert len(scenes[0]) != len(scenes[1]) and size_bucket(len(scenes[0])) == size_bucket(len(scenes[1]))
    torch.manual_seed(0)
    conv = cst.SubMConv3d(16, 32, 3, bias=False).cuda().half()

    def step(coords):
        x = cst.SparseTensor(torch.from_numpy(coords).cuda(),
                             torch.randn(len(coords), 16, device="cuda", dtype=torch.float16).requires_grad_())
        out = conv(x)
        grad_output = torch.randn_like(out.features)
        out.features.backward(grad_output)
        return x, out.features.detach(), grad_output

    step(scenes[0])
    selections = []
    keyed_selection = tuner_module.Tuner._keyed_selection
    monkeypatch.setattr(tuner_module.Tuner, "_keyed_selection",
                        lambda *arguments: selections.append(arguments) or keyed_selection(*arguments))
    conv.weight.grad = None
    x, out, grad_output = step(scenes[1])
    assert selections == []
    monkeypatch.undo()
    kernel_map = x.kernel_map(3).kernel_map
    core = bridge.to_core
    features, weight = core(x.features.detach()), core(conv.weight.detach())
    torch.testing.assert_close(out, bridge.from_core(conv_forward(features, weight, kernel_map)), rtol=0, atol=0)
    grad_input, grad_weight = functional.conv_backward(core(grad_output), features, weight, kernel_map)
    torch.testing.assert_close(x.features.grad, bridge.from_core(grad_input), rtol=0, atol=0)
    torch.testing.assert_close(conv.weight.grad, bridge.from_core(grad_weight), rtol=0, atol=0)


def test_a_planned_layer_still_refuses_mismatched_tensors():
    x, first, _, table = two_layer_inputs(torch.float16)
    with torch.no_grad():
        torch_convolution.convolution(x.features, first.weight, table, "", "")  # the layer's plans are made
        with pytest.raises(ValueError, match="input channels"):
            torch_convolution.convolution(x.features[:, :8].contiguous(), first.weight, table, "", "")
        with pytest.raises(ValueError, match="shape"):
            torch_convolution.convolution(x.features[:-1].contiguous(), first.weight, table, "", "")
        with pytest.raises(TypeError, match="dtype"):
            torch_convolution.convolution(x.features, first.weight.float(), table, "", "")


def test_an_inference_layer_with_padded_channels_sees_each_in_place_update_of_its_weight():
    """A 3-channel input layer's weight is padded for the tensor cores once and kept; each in-place
    update (a write under no_grad, an optimiser's step, load_state_dict) must reach the next forward:
    every output equals the core's over the weight as it is then, bitwise."""
    torch.manual_seed(0)
    coords = coordinates()
    conv = cst.SubMConv3d(3, 32, 3, bias=False, fwd_algo="wmma_implicit_gemm").cuda().half()
    x = cst.SparseTensor(torch.from_numpy(coords).cuda(),
                         torch.randn(len(coords), 3, device="cuda", dtype=torch.float16))
    kernel_map = x.kernel_map(3).kernel_map
    optimizer = torch.optim.SGD(conv.parameters(), lr=0.1)
    conv.weight.grad = torch.randn_like(conv.weight)
    updates = (lambda: None, lambda: None, lambda: conv.weight.mul_(-2.0), optimizer.step,
               lambda: conv.load_state_dict({"weight": torch.randn_like(conv.weight)}))
    for update in updates:
        with torch.no_grad():
            update()
            out = conv(x).features
        expected = conv_forward(bridge.to_core(x.features), bridge.to_core(conv.weight.detach()), kernel_map,
                                "wmma_implicit_gemm")
        torch.testing.assert_close(out, bridge.from_core(expected), rtol=0, atol=0)


def test_a_network_moved_to_the_gpu_prefetches_its_forward_kernels_and_in_training_its_backward_ones(monkeypatch):
    from cupysparse.adapters.torch.networks import MinkUNet18
    from cupysparse.scripts.demo import scene_tensor
    from cupysparse.data.scenes import INDOOR_CLASSES

    tuner_module.default_tuner().forget_choices()  # what earlier tests chose: the prefetch must recall it itself
    model = MinkUNet18(3, len(INDOOR_CLASSES)).eval().to("cuda", torch.float16)
    inference = model.prefetched.result(timeout=300)
    assert inference.choices > 0 and inference.modules > 0  # the shipped sm_90 file ranks the demo's sizes
    _, scene, _ = scene_tensor("indoor", 200_000, 0, "cuda", "float16")
    with monkeypatch.context() as patched, torch.no_grad():
        patched.setattr(tuner_module.Tuner, "_keyed_selection",
                        lambda *arguments: pytest.fail("a layer's choice was not recalled ahead of its first call"))
        model(cst.SparseTensor.from_core(scene))
    model.train()
    training = model.prefetched.result(timeout=300)
    assert training.choices > inference.choices
    assert inference.rehearsed and not training.rehearsed  # training runs other kernels than a rehearsal
    model.eval()
    evaluation = model.prefetched.result(timeout=300)
    assert evaluation is not training and evaluation.rehearsed


def test_a_pointwise_convolution_runs_over_its_identity_map_on_our_kernels_with_and_without_gradients():
    coords = coordinates(seed=3)
    x = cst.SparseTensor(torch.from_numpy(coords).cuda(),
                         torch.randn(len(coords), 24, device="cuda", dtype=torch.float16))
    conv = cst.SubMConv3d(24, 40, 1, bias=True).cuda().half()
    x64, w64 = x.features.double().cpu().numpy(), conv.weight[0].detach().double().cpu().numpy()
    expected = x64 @ w64 + conv.bias.detach().double().cpu().numpy()
    with torch.no_grad():
        out = conv(x)
    assert_close(out.features.double().cpu().numpy(), expected, np.float16, 24, x64, w64, "without gradients")
    assert len(x.core.map_cache) == 1  # the identity map
    differentiated = cst.SparseTensor(x.coordinates, x.features.clone().requires_grad_())  # a map cache of its own
    trained = conv(differentiated)
    assert len(differentiated.core.map_cache) == 1  # the same path with gradients
    assert_close(trained.features.detach().double().cpu().numpy(), expected, np.float16, 24, x64, w64,
                 "with gradients")
    grad_output = torch.randn_like(trained.features)
    trained.features.backward(grad_output)
    dy64 = grad_output.double().cpu().numpy()
    assert_close(differentiated.features.grad.double().cpu().numpy(), dy64 @ w64.T, np.float16, 40, dy64, w64,
                 "input gradient")
    assert_close(conv.weight.grad[0].double().cpu().numpy(), x64.T @ dy64, np.float16, len(coords), x64, dy64,
                 "weight gradient")
