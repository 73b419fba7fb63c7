"""The PyTorch adapter on CPU tensors: gradients by gradcheck in float64, outputs against the core
and against torch's own dense convolution, modules, state dicts, spconv weights, compile, errors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupysparse  # noqa: E402
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.adapters.torch import convolution as torch_convolution  # noqa: E402
from cupysparse.adapters.torch.convolution import TORCH_ARRAYS  # noqa: E402
from cupysparse.tuning.tuner import rehearsal  # noqa: E402
from cupysparse.networks.weight_layouts import to_spconv_weight, to_torch_conv_weight  # noqa: E402


def coordinates(num_per_item=40, batch_size=2, extent=6, seed=0, dims=3) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    items = []
    for b in range(batch_size):
        unique = np.unique(rng.integers(-extent // 2, extent // 2, (num_per_item, dims)), axis=0)
        items.append(np.concatenate([np.full((len(unique), 1), b), unique], axis=1))
    return torch.from_numpy(np.concatenate(items).astype(np.int32))


def sparse(channels=3, dtype=torch.float64, seed=0, requires_grad=True, **kwargs) -> "cst.SparseTensor":
    coords = coordinates(seed=seed, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(len(coords), channels, dtype=dtype, generator=generator, requires_grad=requires_grad)
    return cst.SparseTensor(coords, features)


def through(module_factory, input_factory=sparse):
    """(input, module) in float64 with a fixed seed."""
    torch.manual_seed(0)
    return input_factory(), module_factory().double()


def gradcheck_module(module, x):
    def fn(features, *params):
        out = module(x.replace_feature(features))
        return out if isinstance(out, torch.Tensor) else out.features

    return torch.autograd.gradcheck(fn, (x.features, *module.parameters()), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "factory",
    [
        lambda: cst.SubMConv3d(3, 4, 3),
        lambda: cst.SubMConv3d(3, 4, 3, dilation=2, bias=False),
        lambda: cst.SparseConv3d(3, 4, 2, stride=2),
        lambda: cst.SparseConv3d(3, 4, 3, stride=2),
        lambda: cst.SparseDepthwiseConv(3, 3),
        lambda: cst.SparseMaxPool(2),
        lambda: cst.SparseAvgPool(3, stride=2),
        lambda: cst.GlobalMaxPool(),
        lambda: cst.GlobalAvgPool(),
        lambda: cst.SparseBatchNorm(3),
        lambda: cst.SparseLayerNorm(3),
    ],
    ids=["subm", "subm-dilated", "strided-2", "strided-3", "depthwise", "maxpool", "avgpool", "global-max",
         "global-avg", "batchnorm", "layernorm"],
)
def test_gradcheck_float64(factory):
    x, module = through(factory)
    assert gradcheck_module(module, x)


def test_gradcheck_transposed_and_unpool_back_to_the_encoder_coordinates():
    x = sparse()
    down = x.replace_feature(x.features.detach())
    coarse = cst.SparseConv3d(3, 3, 2, stride=2).double()(down)
    coarse = coarse.replace_feature(coarse.features.detach().requires_grad_())
    up = cst.SparseConvTranspose3d(3, 4, 2, stride=2).double()
    assert up(coarse).coordinates.shape == x.coordinates.shape
    assert gradcheck_module(up, coarse)
    assert gradcheck_module(cst.SparseUnpool(2), coarse)


def test_module_output_equals_the_core_functional_api():
    x, conv = through(lambda: cst.SparseConv3d(3, 5, 3, stride=2))
    out = conv(x)
    core = cupysparse.SparseTensor(x.coordinates.numpy(), x.features.detach().numpy())
    expected = cupysparse.spatially_sparse_conv(core, conv.weight.detach().numpy(), 3, stride=2,
                                                bias=conv.bias.detach().numpy())
    np.testing.assert_array_equal(out.coordinates.numpy(), expected.coordinates)
    np.testing.assert_allclose(out.features.detach().numpy(), expected.features, rtol=1e-12, atol=1e-12)
    assert out.tensor_stride == (2, 2, 2)


def test_batch_norm_in_evaluation_uses_the_running_statistics():
    x = sparse(channels=3, requires_grad=False)
    norm = cst.SparseBatchNorm(3).double().eval()

    def set_statistics(mean, var, weight, bias):
        with torch.no_grad():
            for tensor, values in ((norm.running_mean, mean), (norm.running_var, var), (norm.weight, weight),
                                   (norm.bias, bias)):
                tensor.copy_(torch.tensor(values))

    def expected():
        return ((x.features - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps) * norm.weight
                + norm.bias).detach()

    set_statistics([0.5, -1.0, 2.0], [0.25, 4.0, 1.5], [1.5, -0.5, 2.0], [0.1, 0.2, -0.3])
    with torch.no_grad():
        torch.testing.assert_close(norm(x).features, expected(), rtol=1e-12, atol=1e-12)
        set_statistics([-3.0, 0.0, 1.0], [2.0, 0.5, 9.0], [0.5, 1.0, -1.0], [1.0, -2.0, 0.0])  # seen by the next call
        torch.testing.assert_close(norm(x).features, expected(), rtol=1e-12, atol=1e-12)
    out = norm(x).features  # gradients wanted: the parameters get them
    torch.testing.assert_close(out, expected(), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    torch.testing.assert_close(norm.bias.grad, torch.full((3,), float(len(x)), dtype=torch.float64))
    trained = norm.train()(x).features  # training mode normalises by the batch's own statistics
    torch.testing.assert_close(trained.mean(0), norm.bias.detach(), rtol=1e-9, atol=1e-9)


def test_a_batch_norm_switched_to_training_during_a_rehearsal_changes_no_statistics():
    """A network's rehearsal (`cupysparse.networks.prefetch`) runs an evaluation in the background; a module the
    program switches to training meanwhile keeps normalising by, and leaves alone, its running statistics."""
    x = sparse(channels=3, requires_grad=False)
    norm = cst.SparseBatchNorm(3).double()
    with torch.no_grad():
        norm.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        norm.running_var.copy_(torch.tensor([0.25, 4.0, 1.5]))
        expected = norm.eval()(x).features
    statistics = [tensor.clone() for tensor in (norm.running_mean, norm.running_var, norm.num_batches_tracked)]
    norm.train()
    with torch.no_grad(), rehearsal({}):
        torch.testing.assert_close(norm(x).features, expected, rtol=0, atol=0)
    after = (norm.running_mean, norm.running_var, norm.num_batches_tracked)
    assert all(torch.equal(a, b) for a, b in zip(after, statistics))
    with torch.no_grad():
        norm(x)  # outside a rehearsal, training counts the batch
    assert int(norm.num_batches_tracked) == 1


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_in_training_equals_torch_batch_norm(momentum):
    """Outputs, gradients, running statistics and the batch count of two steps, bit for bit."""
    x = sparse(channels=3, requires_grad=True)
    ours, reference = cst.SparseBatchNorm(3, momentum=momentum).double(), torch.nn.BatchNorm1d(3, momentum=momentum)
    reference = reference.double()
    with torch.no_grad():
        for module in (ours, reference):
            module.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            module.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    for step in range(2):
        features = x.features * (step + 1)
        out, expected = ours(x.replace_feature(features)).features, reference(features)
        assert torch.equal(out, expected)
        grads = torch.autograd.grad(out.square().sum(), (ours.weight, ours.bias))
        expected_grads = torch.autograd.grad(expected.square().sum(), (reference.weight, reference.bias))
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name


def test_relu_module_clamps_at_zero():
    x = sparse(channels=3, requires_grad=False)
    torch.testing.assert_close(cst.SparseReLU()(x).features, x.features.clamp(min=0), rtol=0, atol=0)


def dense_submanifold_reference(x, weight_torch_layout, bias):
    """torch's dense conv3d (zero padding) read at the input voxels: an independent reference."""
    dense, origin = x.to_dense()
    out = torch.nn.functional.conv3d(dense, weight_torch_layout, bias, padding=1)
    index = (x.coordinates[:, 1:] - torch.tensor(origin)).long()
    return out[x.coordinates[:, 0].long(), :, index[:, 0], index[:, 1], index[:, 2]]


def test_spconv_weights_load_and_match_torch_dense_convolution():
    x = sparse(channels=4, requires_grad=False)
    ours = torch.nn.Sequential(cst.SubMConv3d(4, 6, 3)).double()
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((27, 4, 6))
    bias = rng.standard_normal(6)
    spconv_state = {"0.weight": torch.from_numpy(to_spconv_weight(weight, 3)), "0.bias": torch.from_numpy(bias)}
    assert tuple(spconv_state["0.weight"].shape) == (6, 3, 3, 3, 4)  # spconv's [C_out, *k, C_in]
    assert cst.load_spconv_state_dict(ours, spconv_state) == ["0"]
    expected = dense_submanifold_reference(x, torch.from_numpy(to_torch_conv_weight(weight, 3)),
                                           torch.from_numpy(bias))
    torch.testing.assert_close(ours(x).features, expected, rtol=1e-10, atol=1e-10)
    with pytest.raises(KeyError, match="0.weight"):
        cst.load_spconv_state_dict(ours, {})


def test_state_dict_round_trip_and_sequential():
    def make():
        return torch.nn.Sequential(cst.SubMConv3d(3, 8, 3), cst.SparseBatchNorm(8), cst.SparseReLU(),
                                   cst.SparseConv3d(8, 4, 2, stride=2), cst.SparseDepthwiseConv(4, 3)).double()

    torch.manual_seed(0)
    first = make()
    torch.manual_seed(1)
    second = make()
    second.load_state_dict(first.state_dict())
    first.eval(), second.eval()
    x = sparse(requires_grad=False)
    torch.testing.assert_close(first(x).features, second(x).features, rtol=0, atol=0)
    assert set(first.state_dict()) == set(second.state_dict()) and "0.weight" in first.state_dict()


def test_to_dense_places_each_voxel_and_is_differentiable():
    x = sparse(channels=2)
    dense, origin = x.to_dense()
    index = (x.coordinates[:, 1:] - torch.tensor(origin)).long()
    picked = dense[x.coordinates[:, 0].long(), :, index[:, 0], index[:, 1], index[:, 2]]
    torch.testing.assert_close(picked, x.features)
    assert dense.sum().item() == pytest.approx(x.features.sum().item())
    dense.sum().backward()
    torch.testing.assert_close(x.features.grad, torch.ones_like(x.features))


def test_batch_utilities():
    x = sparse(channels=2)
    parts = x.decompose()
    assert len(parts) == x.batch_size == 2 and sum(len(p) for p in parts) == x.num_points
    rebuilt = cst.SparseTensor.collate([x.coordinates[x.coordinates[:, 0] == b, 1:] for b in range(2)], parts)
    torch.testing.assert_close(rebuilt.coordinates, x.coordinates)
    torch.testing.assert_close(rebuilt.features, x.features)


def test_the_decoder_reuses_the_encoders_map():
    x = sparse(requires_grad=False)
    down = cst.SparseConv3d(3, 3, 2, stride=2).double()(x)
    built = len(x.map_cache)
    cst.SparseConvTranspose3d(3, 3, 2, stride=2).double()(down)
    assert len(x.map_cache) == built + 1  # the transposed map, inverted from the strided one
    assert x.map_cache is down.map_cache is down.core.map_cache


def test_autocast_runs_the_convolution_in_the_autocast_dtype():
    x, conv = through(lambda: cst.SubMConv3d(3, 4, 3))
    x = x.replace_feature(x.features.detach().float())
    conv = conv.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x)
    assert out.features.dtype == torch.bfloat16
    reference = conv(x).features
    torch.testing.assert_close(out.features.float(), reference, rtol=0.05, atol=0.05)


def test_compiled_two_layer_block_matches_eager_without_graph_breaks():
    x, first = through(lambda: cst.SubMConv3d(3, 8, 3))
    second = cst.SubMConv3d(8, 4, 3).double()
    table = torch_convolution.pair_table(x.kernel_map(3).kernel_map)

    def block(features, w1, w2):
        hidden = torch.relu(torch_convolution.convolution(features, w1, table, "", ""))
        return torch_convolution.convolution(hidden, w2, table, "", "")

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    args = (x.features, first.weight, second.weight)
    torch.testing.assert_close(compiled(*args), block(*args), rtol=0, atol=0)
    eager_grads = torch.autograd.grad(block(*args).square().sum(), args)
    compiled_grads = torch.autograd.grad(compiled(*args).square().sum(), args)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_custom_ops_pass_torch_library_checks():
    # The checks that clone every input (test_schema, test_faketensor, test_aot_dispatch_*) cannot run:
    # a cloned pair table is no longer the memory of a live kernel map, which the ops refuse, as they
    # should. The fake implementations are exercised by the compile test instead.
    checks = ("test_autograd_registration",)
    x = sparse()
    weight = torch.randn(27, 3, 4, dtype=torch.float64, requires_grad=True)
    table = torch_convolution.pair_table(x.kernel_map(3).kernel_map)
    torch.library.opcheck(torch_convolution.conv_forward, (x.features, weight, table, "", ""), test_utils=checks)
    depthwise = torch.randn(27, 3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch_convolution.depthwise_forward, (x.features, depthwise, table, "", ""), test_utils=checks)
    with pytest.raises(ValueError, match="no live kernel map"):
        torch_convolution.conv_forward(x.features, weight, table.clone(), "", "")


def test_bad_inputs_give_clear_errors():
    x = sparse()
    conv = cst.SubMConv3d(3, 4, 3).double()
    with pytest.raises(TypeError, match="dtype"):
        conv(x.replace_feature(x.features.float()))
    with pytest.raises(ValueError, match="C_in=3"):
        cst.SubMConv3d(4, 4, 3).double()(x)
    wide = torch.randn(len(x.coordinates), 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="contiguous"):
        conv(x.replace_feature(wide[:, ::2]))
    with pytest.raises(TypeError, match="int32"):
        cst.SparseTensor(x.coordinates.long(), x.features)
    with pytest.raises(ValueError, match="meta"):
        cst.sparse_conv(x, torch.empty(27, 3, 4, dtype=torch.float64, device="meta"), 3)
    with pytest.raises(ValueError, match="not_an_algorithm"):
        cst.SubMConv3d(3, 4, 3, fwd_algo="not_an_algorithm")
    with pytest.raises(TypeError, match="SparseTensor"):
        conv(x.features)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_the_overhead_benchmark_says_it_needs_a_gpu(capsys):
    from cupysparse.scripts import benchmark_torch_adapter

    assert benchmark_torch_adapter.main(["--repeats", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_backward_works_after_the_input_tensors_are_collected():
    """The autograd graph alone must keep the kernel maps alive: the sparse tensors that own them
    may be gone, and a garbage collection run, before backward."""
    import gc

    rng = np.random.default_rng(0)
    cells = np.unique(rng.integers(0, 12, (400, 3)), axis=0)
    coords = np.concatenate([np.zeros((len(cells), 1), np.int64), cells], axis=1).astype(np.int32)
    conv = torch.nn.Sequential(cst.SubMConv3d(3, 4, 3), cst.SparseConv3d(4, 4, 2, stride=2),
                               cst.SparseConvTranspose3d(4, 2, 2, stride=2))
    features = torch.randn(len(coords), 3, dtype=torch.float64, requires_grad=True)
    conv = conv.double()
    output = conv(cst.SparseTensor(torch.from_numpy(coords), features)).features
    gc.collect()
    output.sum().backward()
    assert features.grad is not None and torch.isfinite(features.grad).all()
    assert all(parameter.grad is not None for parameter in conv.parameters())


def test_from_core_views_the_core_tensor_and_shares_its_maps():
    rng = np.random.default_rng(1)
    cells = np.unique(rng.integers(0, 10, (300, 3)), axis=0)
    coords = np.concatenate([np.zeros((len(cells), 1), np.int64), cells], axis=1).astype(np.int32)
    core = cupysparse.SparseTensor(coords, rng.standard_normal((len(coords), 5)).astype(np.float32))
    built = core.kernel_map(3)
    tensor = cst.SparseTensor.from_core(core)
    assert tensor.kernel_map(3) is built
    assert tensor.features.data_ptr() == core.features.ctypes.data
    np.testing.assert_array_equal(tensor.coordinates.numpy(), coords)
    with pytest.raises(TypeError, match="cupysparse.SparseTensor"):
        cst.SparseTensor.from_core(tensor)


def test_pointwise_convolution_matches_the_core_and_has_gradients():
    """A 1³ kernel at stride 1 runs as a matrix product; it must equal the core's convolution over
    its (identity) kernel map, bias included, and differentiate in both inputs."""
    rng = np.random.default_rng(2)
    cells = np.unique(rng.integers(0, 9, (200, 3)), axis=0)
    coords = np.concatenate([np.zeros((len(cells), 1), np.int64), cells], axis=1).astype(np.int32)
    features = rng.standard_normal((len(coords), 4))
    weight, bias = rng.standard_normal((1, 4, 6)), rng.standard_normal(6)
    expected = cupysparse.spatially_sparse_conv(cupysparse.SparseTensor(coords, features), weight, 1, bias=bias)
    x = cst.SparseTensor(torch.from_numpy(coords), torch.from_numpy(features).requires_grad_(True))
    w, b = torch.from_numpy(weight).requires_grad_(True), torch.from_numpy(bias).requires_grad_(True)
    out = cst.sparse_conv(x, w, 1, bias=b)
    np.testing.assert_allclose(out.features.detach().numpy(), expected.features, rtol=1e-12, atol=1e-12)
    assert out.kernel_map(3) is x.kernel_map(3)  # same coordinates and map cache
    torch.autograd.gradcheck(lambda f, w_, b_: cst.sparse_conv(cst.SparseTensor(x.coordinates, f), w_, 1,
                                                                bias=b_).features, (x.features, w, b))
    with pytest.raises(ValueError, match=r"\[K=1, C_in=4, C_out\]"):
        cst.sparse_conv(x, w[:, :3], 1)
    with pytest.raises(ValueError):
        cst.sparse_conv(x, w, 1, fwd_algo="no_such_algorithm")


def test_an_inference_weight_is_padded_once_and_again_after_each_update():
    """What a planned inference layer reads: the weight zero-padded to the kernels' channel multiples,
    kept from call to call until the weight is updated in place or replaced."""
    weight = torch.nn.Parameter(torch.randn(27, 3, 20, dtype=torch.float64))
    shape = (27, 16, 32)

    def expected():
        padded = torch.zeros(shape, dtype=torch.float64)
        padded[:, :3, :20] = weight.detach()
        return padded

    kept = TORCH_ARRAYS.padded_weight(weight, shape, False, True)
    assert torch.equal(kept, expected())
    assert TORCH_ARRAYS.padded_weight(weight, shape, False, True) is kept
    with torch.no_grad():
        weight.mul_(-2.0)
    assert torch.equal(TORCH_ARRAYS.padded_weight(weight, shape, False, True), expected())
    weight.grad = torch.ones_like(weight)
    torch.optim.SGD([weight], lr=0.5).step()
    assert torch.equal(TORCH_ARRAYS.padded_weight(weight, shape, False, True), expected())
    weight.data = torch.randn(27, 3, 20, dtype=torch.float64)
    assert torch.equal(TORCH_ARRAYS.padded_weight(weight, shape, False, True), expected())
    unpadded = torch.randn(27, 16, 32)
    assert TORCH_ARRAYS.padded_weight(unpadded, shape, False, True) is unpadded  # already the kernels' layout


def test_a_transposed_padded_weight_is_each_offsets_matrix_transposed_then_padded():
    """A forward plan with `weight_transposed` (wgmma's TF32) reads `[K, C_out_pad, C_in_pad]`; kept
    apart from the untransposed copy of the same weight."""
    weight = torch.nn.Parameter(torch.randn(27, 16, 20, dtype=torch.float64))
    expected = torch.zeros(27, 32, 16, dtype=torch.float64)
    expected[:, :20, :] = weight.detach().transpose(1, 2)
    for padded in (TORCH_ARRAYS.padded_weight(weight, (27, 32, 16), True, False),
                   TORCH_ARRAYS.padded_weight(weight, (27, 32, 16), True, True)):
        assert padded.is_contiguous() and torch.equal(padded, expected)
    square = torch.randn(27, 16, 16, dtype=torch.float64)
    kept = TORCH_ARRAYS.padded_weight(square, (27, 16, 16), True, True)
    assert kept.is_contiguous() and torch.equal(kept, square.transpose(1, 2))
    assert TORCH_ARRAYS.padded_weight(square, (27, 16, 16), True, True) is kept
    assert TORCH_ARRAYS.padded_weight(square, (27, 16, 16), False, True) is square
