"""Batch norm in training with the ReLU and residual sum after it (`cupysparse.functional.training_norm`):
the NumPy reference against torch's batch norm, ReLU and sum differentiated by autograd in float64 (on the
CPU), and the GPU kernels against the reference in float64 over the same rounded inputs."""

import numpy as np
import pytest

from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64
import cupysparse as cs
from cupysparse.functional import training_norm
from cupysparse.functional.execution import core_arrays
from tolerances import EPSILON, assert_close

EPS, MOMENTUM = 1e-5, 0.1
LOW_PRECISION = [FLOAT16] + ([BFLOAT16] if BFLOAT16 is not None else [])
CASES = [  # (residual, relu, affine)
    (False, False, True), (False, True, True), (True, True, True), (True, False, False), (False, True, False),
]


def inputs(num_rows: int, channels: int, dtype, parameter_dtype, seed: int = 0) -> dict:
    """Features with a mean far from zero against their spread (what the shifted sums are for), a residual,
    an output gradient, parameters and running statistics, rounded to their dtypes."""
    rng = np.random.default_rng(seed)
    return {
        "features": (rng.standard_normal((num_rows, channels)) * rng.uniform(0.5, 2, channels)
                     + rng.uniform(-8, 8, channels)).astype(dtype),
        "residual": rng.standard_normal((num_rows, channels)).astype(dtype),
        "grad_out": rng.standard_normal((num_rows, channels)).astype(dtype),
        "weight": rng.uniform(-1.5, 1.5, channels).astype(parameter_dtype),
        "bias": rng.uniform(-0.5, 0.5, channels).astype(parameter_dtype),
        "running_mean": rng.uniform(-1, 1, channels).astype(parameter_dtype),
        "running_var": rng.uniform(0.5, 2, channels).astype(parameter_dtype),
    }


def run(arrays: dict, residual: bool, relu: bool, affine: bool, xp=np):
    """(out, grad_features, grad_weight, grad_bias, grad_residual, running_mean, running_var) of one step."""
    args = {name: xp.asarray(value).copy() for name, value in arrays.items()}
    weight, bias = (args["weight"], args["bias"]) if affine else (None, None)
    out, mean, invstd = cs.training_batch_norm(args["features"], args["running_mean"], args["running_var"], weight,
                                               bias, MOMENTUM, EPS, residual=args["residual"] if residual else None,
                                               relu=relu)
    grads = cs.training_batch_norm_backward(args["grad_out"], args["features"], out, mean, invstd, weight, relu=relu,
                                            with_residual=residual)
    return out, *grads, args["running_mean"], args["running_var"]


def reference(arrays: dict, residual: bool, relu: bool, affine: bool):
    """`run` in float64 on the rounded inputs."""
    return run({name: np.asarray(value, np.float64) for name, value in arrays.items()}, residual, relu, affine)


@pytest.mark.parametrize("residual, relu, affine", CASES)
def test_the_reference_is_torchs_batch_norm_relu_and_sum_differentiated(residual, relu, affine):
    torch = pytest.importorskip("torch")
    arrays = inputs(301, 12, FLOAT64, FLOAT64)
    got = reference(arrays, residual, relu, affine)
    tensors = {name: torch.tensor(value, requires_grad=name in ("features", "residual", "weight", "bias"))
               for name, value in arrays.items()}
    running_mean, running_var = tensors["running_mean"].clone(), tensors["running_var"].clone()
    out = torch.nn.functional.batch_norm(tensors["features"], running_mean, running_var,
                                         tensors["weight"] if affine else None, tensors["bias"] if affine else None,
                                         True, MOMENTUM, EPS)
    if residual:
        out = out + tensors["residual"]
    if relu:
        out = torch.relu(out)
    out.backward(tensors["grad_out"])
    expected = [out.detach(), tensors["features"].grad]
    expected += [tensors["weight"].grad, tensors["bias"].grad] if affine else [None, None]
    expected += [tensors["residual"].grad if residual else None, running_mean, running_var]
    names = ["out", "grad_features", "grad_weight", "grad_bias", "grad_residual", "running_mean", "running_var"]
    for name, value, wanted in zip(names, got, expected):
        if wanted is None or (name in ("grad_weight", "grad_bias") and not affine):
            continue
        np.testing.assert_allclose(value, wanted.numpy(), rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("residual, relu, affine", CASES)
def test_the_reference_of_many_fp32_rows_far_from_zero_is_their_float64_result_rounded(residual, relu, affine):
    """Summed down the rows in fp32, 20,000 rows of a mean far from their spread put the input gradient 8% off;
    the reference sums in float64, so fp32 arrays get the float64 result of their values, rounded once."""
    arrays = inputs(20_000, 16, FLOAT32, FLOAT32, seed=3)
    got, expected = run(arrays, residual, relu, affine), reference(arrays, residual, relu, affine)
    names = ["out", "grad_features", "grad_weight", "grad_bias", "grad_residual", "running_mean", "running_var"]
    for name, value, wanted in zip(names, got, expected):
        if value is None:
            continue
        difference = np.abs(np.asarray(value, np.float64) - wanted).max()
        assert difference <= 2 * np.finfo(np.float32).eps * np.abs(wanted).max(), name


def test_kernels_take_the_channel_counts_a_block_holds():
    assert training_norm.kernel_runs(np.dtype(FLOAT16), np.dtype(FLOAT32), 96)  # 12 groups of 8
    assert training_norm.kernel_runs(np.dtype(FLOAT16), np.dtype(FLOAT16), 2048)  # 256 groups of 8
    assert not training_norm.kernel_runs(np.dtype(FLOAT16), np.dtype(FLOAT16), 2056)
    assert training_norm.kernel_runs(np.dtype(FLOAT32), np.dtype(FLOAT32), 250)  # no vector: 250 groups of 1
    assert not training_norm.kernel_runs(np.dtype(FLOAT32), np.dtype(FLOAT32), 258)
    assert not training_norm.kernel_runs(np.dtype(FLOAT16), np.dtype(np.float64), 32)
    assert not training_norm.kernel_runs(np.dtype(FLOAT64), np.dtype(FLOAT64), 32)



def test_a_pass_launches_one_wave_at_most_and_no_more_blocks_than_the_workspace_has_rows_for(monkeypatch):
    """Each pass's grid covers its rows with blocks up to the blocks the GPU holds of its kernel at once (one
    wave), and never more than `reduction_floats` holds block sums for, whatever the kernel's occupancy."""
    resident = {"statistics": 4, "normalise": 5, "gradient_sums": 4, "input_gradient": 16, "renormalise": 6}

    class Kernels:
        def prepared(self, name, block, num_arguments):
            kind = name.removeprefix("batch_norm_").split("<")[0]
            return type("Launch", (), {"resident_blocks": lambda self: resident[kind]})()

    monkeypatch.setattr(training_norm, "_KERNELS", {np.dtype(FLOAT16): Kernels()})
    monkeypatch.setattr(training_norm, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(training_norm, "resident_threads", lambda device: 132 * 2048)
    training_norm._launches.cache_clear()
    try:
        passes = training_norm._launches(0, np.dtype(FLOAT16), np.dtype(FLOAT16), 8)
    finally:
        training_norm._launches.cache_clear()  # it holds the stand-ins
    # 400,390 rows of 96 fp16 channels: 12 groups of 8 a row, 21 rows a block, 19,067 blocks to cover them.
    assert [step.grid(400_390, 96, 8) for step in passes] == [(528, 1, 1), (660, 1, 1), (528, 1, 1), (1056, 1, 1),
                                                              (792, 1, 1)]
    assert training_norm._max_blocks(0) == 1056  # the block sums the workspace has rows for
    # 1,336 rows of 256 channels: 32 groups, 8 rows a block, 167 blocks; and one block for a single row.
    assert {step.grid(1336, 256, 8) for step in passes} == {(167, 1, 1)}
    assert {step.grid(1, 32, 8) for step in passes} == {(1, 1, 1)}

# (rows, channels): 16-byte vectors of every dtype; channel groups that leave idle threads in a block (96
# fp16 channels: 12 groups of 8, 20: 20 groups of 1); 3 channels; many rows per thread.
GPU_SHAPES = [(1001, 32), (999, 20), (517, 3), (3000, 96), (40_000, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("residual, relu, affine", CASES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
@pytest.mark.parametrize("dtype, parameter_dtype", [(FLOAT32, FLOAT32)]
                         + [(dtype, parameter) for dtype in LOW_PRECISION for parameter in (dtype, FLOAT32)])
def test_gpu_kernels_equal_the_float64_reference(dtype, parameter_dtype, shape, residual, relu, affine):
    arrays = inputs(*shape, dtype, parameter_dtype, seed=shape[0])
    got = [None if value is None else value.get() for value in run(arrays, residual, relu, affine, cupy_module())]
    expected = reference(arrays, residual, relu, affine)
    out, grad_features, grad_weight, grad_bias, grad_residual, running_mean, running_var = got
    assert out.dtype == dtype and grad_features.dtype == dtype
    eps = EPSILON[np.dtype(dtype).name]
    rounded_out = expected[0].astype(dtype).astype(np.float64)
    # The output: its dtype's rounding of values of order |weight| + |bias| (+ |residual|); where the ReLU
    # clips, a value within that of zero may land on either side.
    size = 3.0 + (4.0 if residual else 0.0)
    np.testing.assert_array_less(np.abs(out.astype(np.float64) - rounded_out), 2 * eps * size)
    # The input gradient: three terms of order |weight| · invstd · |g|, each rounded once; elements whose
    # ReLU mask differs from the float64 one (the output within rounding of zero, or below the dtype's
    # smallest value, which rounds a positive output to zero) are left out.
    same_mask = (out > 0) == (expected[0] > 0) if relu else np.ones(out.shape, bool)
    scale = np.abs(np.asarray(arrays["weight"], np.float64)) if affine else 1.0
    invstd = 1 / np.asarray(arrays["features"], np.float64).std(axis=0)
    bound = 8 * eps * scale * invstd * (1 + np.abs(np.asarray(arrays["grad_out"], np.float64)))
    difference = np.abs(grad_features.astype(np.float64) - expected[1])
    np.testing.assert_array_less(difference[same_mask], np.broadcast_to(bound, out.shape)[same_mask])
    if residual:
        np.testing.assert_array_equal(grad_residual[same_mask], expected[4].astype(dtype)[same_mask])
    if affine and not relu:  # with the ReLU, an output on the edge moves a term in or out of the sums
        xhat = (np.asarray(arrays["features"], np.float64) - np.asarray(arrays["features"], np.float64).mean(0)) * invstd
        assert_close(grad_weight, expected[2], parameter_dtype, shape[0], arrays["grad_out"], xhat, "grad_weight")
        assert_close(grad_bias, expected[3], parameter_dtype, shape[0], arrays["grad_out"], np.ones(1), "grad_bias")
    parameter_eps = EPSILON[np.dtype(parameter_dtype).name]
    np.testing.assert_allclose(running_mean, expected[5], rtol=4 * parameter_eps, atol=4 * parameter_eps)
    np.testing.assert_allclose(running_var, expected[6], rtol=4 * parameter_eps, atol=4 * parameter_eps)


def renormalised(arrays: dict, residual: bool, relu: bool, affine: bool, xp=np):
    """(out of a forward, the same output recomputed by `renormalise` from its statistics)."""
    args = {name: xp.asarray(value).copy() for name, value in arrays.items()}
    weight, bias = (args["weight"], args["bias"]) if affine else (None, None)
    residual = args["residual"] if residual else None
    out, mean, invstd = cs.training_batch_norm(args["features"], args["running_mean"], args["running_var"], weight,
                                               bias, MOMENTUM, EPS, residual=residual, relu=relu)
    running = args["running_mean"].copy(), args["running_var"].copy()
    again = training_norm.renormalise(args["features"], mean, invstd, weight, bias, residual=residual, relu=relu)
    for before, after in zip(running, (args["running_mean"], args["running_var"])):
        assert (before == after).all()  # the running statistics moved once, by the forward
    return out, again


@pytest.mark.parametrize("residual, relu, affine", CASES)
def test_the_output_recomputed_from_the_saved_statistics_is_the_forwards_on_the_cpu(residual, relu, affine):
    out, again = renormalised(inputs(301, 12, FLOAT32, FLOAT32), residual, relu, affine)
    np.testing.assert_array_equal(again, out)


@pytest.mark.gpu
@pytest.mark.parametrize("residual, relu, affine", CASES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
@pytest.mark.parametrize("dtype, parameter_dtype", [(FLOAT32, FLOAT32)]
                         + [(dtype, parameter) for dtype in LOW_PRECISION for parameter in (dtype, FLOAT32)])
def test_the_output_recomputed_from_the_saved_statistics_has_the_forwards_bits(dtype, parameter_dtype, shape,
                                                                               residual, relu, affine):
    """A network's backward recomputes a batch norm's output it did not keep: the kernel that does gives the
    forward's bits, so the ReLU's mask and the next convolution's weight gradient see what the forward gave."""
    arrays = inputs(*shape, dtype, parameter_dtype, seed=shape[0] + 1)
    out, again = renormalised(arrays, residual, relu, affine, cupy_module())
    np.testing.assert_array_equal(again.get(), out.get())


@pytest.mark.gpu
@pytest.mark.parametrize("terminal", [False, True], ids=["chain of three", "two over a residual"])
@pytest.mark.parametrize("dtype, parameter_dtype", [(FLOAT32, FLOAT32), (FLOAT16, FLOAT16), (FLOAT16, FLOAT32)])
def test_a_chain_of_norms_recomputed_in_one_pass_has_the_forwards_bits(dtype, parameter_dtype, terminal):
    """Three norms as in residual blocks: a shortcut's (no ReLU), a block's output over it, the next block's
    output over that. One pass from their inputs and saved statistics gives the last one's forward output, bit
    for bit; or two of them over the first one's output given as a residual."""
    cupy = cupy_module()
    outputs, links, statistics, residual = [], [], [], None
    for seed, relu in ((5, False), (6, True), (7, True)):
        args = {name: cupy.asarray(value) for name, value in inputs(3000, 96, dtype, parameter_dtype, seed).items()}
        out, mean, invstd = cs.training_batch_norm(args["features"], args["running_mean"], args["running_var"],
                                                   args["weight"], args["bias"], MOMENTUM, EPS, residual=residual,
                                                   relu=relu)
        outputs.append(out)
        statistics += [mean, invstd]  # the links hold their addresses only
        links.insert(0, training_norm.NormLink(args["features"], args["weight"], args["bias"], mean.data.ptr,
                                               invstd.data.ptr, relu))
        residual = out
    given = outputs[0] if terminal else None
    again = training_norm.run_renormalise(core_arrays(), links[:2] if terminal else links, given,
                                          np.dtype(parameter_dtype))
    np.testing.assert_array_equal(again.get(), outputs[-1].get())


def test_arguments_are_checked_before_anything_runs():
    arrays = inputs(50, 4, FLOAT32, FLOAT32)
    stats = arrays["running_mean"], arrays["running_var"]
    with pytest.raises(ValueError, match="at least 2 rows"):
        cs.training_batch_norm(arrays["features"][:1], *stats)
    with pytest.raises(ValueError, match="weight has 3 channels but the features have 4"):
        cs.training_batch_norm(arrays["features"], *stats, weight=arrays["weight"][:3])
    with pytest.raises(ValueError, match="residual must be fp32 of shape"):
        cs.training_batch_norm(arrays["features"], *stats, residual=arrays["residual"][:10])
    with pytest.raises(TypeError, match="running_var is required"):
        cs.training_batch_norm(arrays["features"], arrays["running_mean"], None)
    with pytest.raises(ValueError, match="momentum must be a number in"):
        cs.training_batch_norm(arrays["features"], *stats, momentum=None)
    out, mean, invstd = cs.training_batch_norm(arrays["features"], *stats)
    with pytest.raises(ValueError, match="grad_output must be fp32 of shape"):
        cs.training_batch_norm_backward(arrays["grad_out"][:, :2], arrays["features"], out, mean, invstd)
    with pytest.raises(ValueError, match="mean has 3 channels"):
        cs.training_batch_norm_backward(arrays["grad_out"], arrays["features"], out, mean[:3], invstd)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["non-contiguous features", "parameters of two dtypes"])
def test_arrays_the_kernels_do_not_take_as_they_are_run_through_the_reference(layout):
    """Strided features, or a weight in fp16 beside fp32 statistics, leave the kernels out: the reference runs
    on the GPU's arrays, with the same results."""
    arrays = inputs(400, 8, FLOAT16, FLOAT32)
    cupy = cupy_module()
    args = {name: cupy.asarray(value) for name, value in arrays.items()}
    features, weight = args["features"], args["weight"]
    if layout == "non-contiguous features":
        wide = cupy.zeros((features.shape[0], 2 * features.shape[1]), features.dtype)
        wide[:, ::2] = features
        features = wide[:, ::2]  # the same values, every other element of its rows
    else:
        weight = weight.astype(FLOAT16)
    assert training_norm._kernel_parameter_dtype(features, (weight, args["running_mean"]), ()) is None
    out, mean, invstd = cs.training_batch_norm(features, args["running_mean"], args["running_var"], weight, relu=True)
    expected = training_norm._forward_reference(np.asarray(arrays["features"]), np.asarray(weight.get()), None,
                                                arrays["running_mean"].copy(), arrays["running_var"].copy(), 0.1,
                                                1e-5, None, True)[0]
    # The same formula in float64, on the GPU and on the CPU: each output within one fp16 rounding of the other.
    eps = EPSILON["float16"]
    np.testing.assert_allclose(out.get().astype(np.float64), expected.astype(np.float64), rtol=eps, atol=eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16], ids=lambda dtype: np.dtype(dtype).name)
def test_gpu_kernels_give_the_same_bits_every_run(dtype):
    """Each block's sums are added in block order by the last block of the pass, not by atomic adds in whatever
    order the blocks finish: a step over the same inputs gives the same bits each time (here on enough rows
    for the largest grid, a thousand blocks on an H100)."""
    arrays = inputs(300_000, 32, dtype, FLOAT32, seed=3)
    runs = [[None if value is None else value.get() for value in run(arrays, True, True, True, cupy_module())]
            for _ in range(4)]
    for again in runs[1:]:
        for first, value in zip(runs[0], again):
            np.testing.assert_array_equal(value, first)


@pytest.mark.gpu
def test_norms_sharing_one_reduction_workspace_equal_norms_with_their_own():
    """The passes of one stream share a reduction workspace, as a network's training step does: each pass leaves
    its ticket at zero for the next, whatever its grid, so norms of several shapes in a row, through one workspace
    zeroed once (and the backward's sums in the first rows of the forward's scratch), give the same bits as each
    norm through workspaces of its own."""
    cupy = cupy_module()
    core = core_arrays()
    widest = max(channels for _, channels in GPU_SHAPES)
    shared = cupy.zeros(training_norm.reduction_floats(widest), np.float32)

    def step(args, scratch=None, reduction=None):
        out, statistics, _ = training_norm.run_forward(
            core, args["features"], args["residual"], args["weight"], args["bias"], args["running_mean"].copy(),
            args["running_var"].copy(), MOMENTUM, EPS, True, np.dtype(FLOAT32), scratch=scratch, reduction=reduction)
        grad_features, grads, g = training_norm.run_backward(
            core, args["grad_out"], args["features"], out, statistics, args["weight"], True, True, np.dtype(FLOAT32),
            True, sums=scratch, reduction=reduction)
        return [array.get() for array in (out, grad_features, grads, g)]

    for rows, channels in GPU_SHAPES:
        args = {name: cupy.asarray(value) for name, value in inputs(rows, channels, FLOAT16, FLOAT32, rows).items()}
        scratch = cupy.empty((training_norm.FORWARD_SCRATCH_ROWS, channels), np.float32)
        own = step(args)
        for expected, got in zip(own, step(args, scratch.data.ptr, shared.data.ptr)):
            np.testing.assert_array_equal(got, expected)
