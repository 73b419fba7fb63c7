"""spconv models converted by `from_spconv`, against spconv itself; the torch modules' padding, inverse
convolutions and indice keys against dense torch convolutions.

With spconv (2.3.8; its CPU build single-threaded, its CUDA build under `pytest -m gpu`): a SECOND /
CenterPoint-style backbone (SubMConv3d + BatchNorm1d + ReLU blocks, `SparseConv3d(k=3, stride=2,
padding=1)` downsampling, indice keys), a small U-Net whose decoder is `SparseInverseConv3d`s with skip
connections, and a 2D model of every other convolution kind are run in evaluation by both libraries on
the same input: after every convolution the output coordinates must be equal as sets, and the features,
rows matched by coordinates, agree within the sum of the two libraries' error bounds
(`tolerances.assert_agree`, over that convolution's terms); so must the model's output.

Without spconv: `SparseConv3d(padding=...)`, `SparseInverseConv3d` and spconv's transposed convolution are
a dense `conv3d` / `conv_transpose3d` over the box of the spatial shape (inactive voxels zero), read at the
active voxels, the active outputs being those the dense convolution of the occupancy reaches.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from cupysparse.adapters import torch as cst
from cupysparse.adapters.torch.spconv import SpconvConversionError
from tolerances import assert_agree
from torch import nn
from torch.nn import functional as F

from cupysparse.networks.weight_layouts import to_torch_conv_weight

ON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CASES = [("cpu", "float32"), ("cpu", "float16"), pytest.param("cuda", "float32", marks=pytest.mark.gpu),
         pytest.param("cuda", "float16", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def spconv():
    """spconv's torch modules, its CPU build single-threaded (its threads and torch's would compete)."""
    module = pytest.importorskip("spconv.pytorch", reason="spconv 2.x is the reference here")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield module
    torch.set_num_threads(threads)


def scene(spatial_shape, rows_per_item: int, seed: int, items: int = 2) -> torch.Tensor:
    """int32 `[N, 1 + D]`: `items` batch items of distinct voxels inside `spatial_shape`, in random order."""
    rng = np.random.default_rng(seed)
    parts = []
    for batch in range(items):
        voxels = np.unique(np.stack([rng.integers(0, size, rows_per_item) for size in spatial_shape], axis=1), axis=0)
        parts.append(np.concatenate([np.full((len(voxels), 1), batch), rng.permutation(voxels)], axis=1))
    return torch.from_numpy(np.concatenate(parts).astype(np.int32))


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Batch norms with statistics and affine parameters far from the identity, biases non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.copy_(torch.randn(module.num_features, generator=generator))
                module.running_var.copy_(torch.rand(module.num_features, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(torch.randn(module.num_features, generator=generator))
                module.bias.copy_(torch.randn(module.num_features, generator=generator))
            bias = getattr(module, "bias", None)
            if not isinstance(module, nn.BatchNorm1d) and isinstance(bias, nn.Parameter):
                bias.copy_(torch.randn(bias.shape, generator=generator))
    return model


def evaluated(spconv, model: nn.Module, device: str, dtype: torch.dtype) -> nn.Module:
    """`model` in evaluation on `device` in `dtype`, its convolutions on spconv's Native algorithm (gather,
    matrix products, scatter; the only one of its CPU build), as in test_spconv_oracle: on the GPU its implicit
    GEMMs tune themselves on every new shape and choose their fp16 accumulation themselves. spconv's CPU build
    adds a convolution's bias only in training (in evaluation it asserts), so there its biased convolutions run
    in training mode, which changes nothing else of a convolution."""
    model = model.to(device, dtype).eval()
    for module in model.modules():
        if isinstance(module, spconv.conv.SparseConvolution):
            module.algo = spconv.ConvAlgo.Native
            if device == "cpu" and module.bias is not None:
                module.train()
    return model


def rows_of(coordinates: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row) for row in coordinates.tolist()]


def matching(ours: list, theirs: list) -> np.ndarray:
    """`order` with `theirs[order[i]] == ours[i]`, after asserting the two hold the same coordinates."""
    assert set(ours) == set(theirs) and len(ours) == len(theirs), "the output coordinates differ"
    where = {row: i for i, row in enumerate(theirs)}
    return np.array([where[row] for row in ours], dtype=np.int64)


def host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().double().cpu().numpy()


def convolution_outputs(model: nn.Module, kinds: tuple) -> tuple[dict, list]:
    """Hooks recording, by module path, each convolution's (input features, output) in `model`."""
    seen, handles = {}, []
    for path, module in model.named_modules():
        if isinstance(module, kinds):
            def record(module, inputs, output, path=path):
                seen[path] = (inputs[0].features, output)
            handles.append(module.register_forward_hook(record))
    return seen, handles


def assert_same_function(spconv, model: nn.Module, converted: nn.Module, coordinates, spatial_shape, channels: int,
                         device: str, dtype_name: str) -> None:
    """Both models on the same input: every convolution's output, and the model's, as the module docstring says."""
    dtype = getattr(torch, dtype_name)
    features = torch.randn(len(coordinates), channels, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    coordinates = coordinates.to(device)
    theirs_in = spconv.SparseConvTensor(features, coordinates, list(spatial_shape), int(coordinates[:, 0].max()) + 1)
    ours_in = cst.from_spconv_tensor(theirs_in)
    their_layers, their_hooks = convolution_outputs(model, (spconv.conv.SparseConvolution,))
    our_layers, our_hooks = convolution_outputs(converted, (cst.SpatiallySparseConv,))
    with torch.no_grad():
        theirs, ours = model(theirs_in), converted(ours_in)
    for handle in their_hooks + our_hooks:
        handle.remove()
    assert list(our_layers) == list(their_layers)
    # The models end in a convolution: their outputs are the last one's, compared below.
    assert ours is our_layers[next(reversed(our_layers))][1] and theirs is their_layers[next(reversed(their_layers))][1]
    for path, (our_input, out) in our_layers.items():
        their_out = their_layers[path][1]
        order = matching(rows_of(out.coordinates), rows_of(their_out.indices))
        assert out.spatial_shape == tuple(their_out.spatial_shape), path
        module = converted.get_submodule(path)
        assert_agree(host(out.features), host(their_out.features)[order], dtype_name,
                     module.weight.shape[0] * module.in_channels, host(our_input), host(module.weight),
                     f"output of {path} ({module})")


def second_backbone(spconv) -> nn.Module:
    """VoxelBackBone8x's pattern, narrowed: an input block, three downsamplings by padded strided
    convolutions each followed by submanifold blocks sharing a key, and CenterPoint's (3, 1, 1) output
    convolution (without its batch norm and ReLU: the model ends in the convolution compared last)."""
    def block(c_in, c_out, key, stride=1, padding=0, kind="subm"):
        if kind == "subm":
            conv = spconv.SubMConv3d(c_in, c_out, 3, padding=1, bias=False, indice_key=key)
        else:
            conv = spconv.SparseConv3d(c_in, c_out, 3, stride=stride, padding=padding, bias=False, indice_key=key)
        return spconv.SparseSequential(conv, nn.BatchNorm1d(c_out, eps=1e-3, momentum=0.01), nn.ReLU())

    return spconv.SparseSequential(
        spconv.SparseSequential(spconv.SubMConv3d(4, 16, 3, padding=1, bias=False, indice_key="subm1"),
                                nn.BatchNorm1d(16, eps=1e-3, momentum=0.01), nn.ReLU()),
        spconv.SparseSequential(block(16, 16, "subm1")),
        spconv.SparseSequential(block(16, 32, "spconv2", 2, 1, "down"), block(32, 32, "subm2"), block(32, 32, "subm2")),
        spconv.SparseSequential(block(32, 64, "spconv3", 2, 1, "down"), block(64, 64, "subm3"), block(64, 64, "subm3")),
        spconv.SparseSequential(block(64, 64, "spconv4", 2, (0, 1, 1), "down"), block(64, 64, "subm4")),
        spconv.SparseConv3d(64, 32, (3, 1, 1), stride=(2, 1, 1), padding=0, bias=False, indice_key="spconv_down2"),
    )


@pytest.mark.parametrize(("device", "dtype_name"), CASES)
def test_a_second_style_backbone_computes_what_spconv_computes(spconv, device, dtype_name):
    torch.manual_seed(0)
    model = evaluated(spconv, randomise(second_backbone(spconv), seed=1), device, getattr(torch, dtype_name))
    converted = cst.from_spconv(model)
    spatial_shape = (41, 40, 36)  # z, y, x as spconv orders them: our coordinate columns 1..3
    assert_same_function(spconv, model, converted, scene(spatial_shape, 900, seed=2), spatial_shape, 4, device,
                         dtype_name)


class UNet(nn.Module):
    """Two padded downsamplings with indice keys; the decoder inverts them (`SparseInverseConv3d`), each time
    concatenating the encoder's features of the same coordinates, and ends in a biased 1x1x1 head."""

    def __init__(self, spconv):
        super().__init__()
        def norm(channels):
            return nn.BatchNorm1d(channels), nn.ReLU()

        self.stem = spconv.SparseSequential(spconv.SubMConv3d(3, 8, 3, indice_key="subm0"), *norm(8))
        self.down1 = spconv.SparseSequential(
            spconv.SparseConv3d(8, 16, 3, 2, padding=1, bias=False, indice_key="down1"), *norm(16),
            spconv.SubMConv3d(16, 16, 3, indice_key="subm1"), *norm(16))
        self.down2 = spconv.SparseSequential(spconv.SparseConv3d(16, 32, 2, 2, indice_key="down2"), *norm(32),
                                             spconv.SubMConv3d(32, 32, 3, bias=False, indice_key="subm2"))
        self.up2 = spconv.SparseSequential(spconv.SparseInverseConv3d(32, 16, 2, indice_key="down2"), *norm(16))
        self.merge1 = spconv.SparseSequential(spconv.SubMConv3d(32, 16, 3, indice_key="subm1"), *norm(16))
        self.up1 = spconv.SparseInverseConv3d(16, 8, 3, indice_key="down1", bias=False)
        self.head = spconv.SubMConv3d(16, 5, 1)

    def forward(self, x):
        x0 = self.stem(x)
        x1 = self.down1(x0)
        up = self.up2(self.down2(x1))
        up = self.merge1(up.replace_feature(torch.cat([up.features, x1.features], dim=1)))
        up = self.up1(up)
        return self.head(up.replace_feature(torch.cat([up.features, x0.features], dim=1)))


@pytest.mark.parametrize(("device", "dtype_name"), CASES)
def test_a_unet_with_inverse_convolutions_computes_what_spconv_computes(spconv, device, dtype_name):
    torch.manual_seed(0)
    model = evaluated(spconv, randomise(UNet(spconv), seed=3), device, getattr(torch, dtype_name))
    converted = cst.from_spconv(model)
    assert type(converted) is UNet and isinstance(converted.up1, cst.SparseInverseConv3d)
    spatial_shape = (24, 20, 13)
    assert_same_function(spconv, model, converted, scene(spatial_shape, 500, seed=4), spatial_shape, 3, device,
                         dtype_name)


@pytest.mark.parametrize(("device", "dtype_name"), CASES)
def test_2d_regular_transposed_and_1x1_convolutions_compute_what_spconv_computes(spconv, device, dtype_name):
    """The other kinds, in 2D: a stride-1 regular convolution (it dilates the active set), padded and unpadded
    strided ones, spconv's transposed convolution (it creates voxels), a 1x1 one (a matrix product in spconv),
    an inverse, and a torch module spconv applies to the features (`PerVoxel`)."""
    torch.manual_seed(0)
    model = spconv.SparseSequential(
        spconv.SubMConv2d(3, 6, 3, indice_key="subm"), nn.BatchNorm1d(6), nn.LeakyReLU(0.1),
        spconv.SparseConv2d(6, 8, 3, stride=1, padding=1, indice_key="regular"), nn.ReLU(),
        spconv.SparseConv2d(8, 8, (3, 2), stride=(2, 3), padding=(1, 0), dilation=(2, 1), indice_key="down"),
        spconv.SparseConv2d(8, 8, 1),
        spconv.SparseInverseConv2d(8, 6, (3, 2), indice_key="down"),
        spconv.SparseConvTranspose2d(6, 4, 3, stride=2, padding=1),
    )
    model = evaluated(spconv, randomise(model, seed=5), device, getattr(torch, dtype_name))
    converted = cst.from_spconv(model)
    assert isinstance(converted[2], cst.PerVoxel) and isinstance(converted[2].module, nn.LeakyReLU)
    spatial_shape = (30, 26)
    assert_same_function(spconv, model, converted, scene(spatial_shape, 150, seed=6), spatial_shape, 3, device,
                         dtype_name)


def test_the_conversion_copies_weights_statistics_modes_and_leaves_the_model_alone(spconv):
    model = randomise(UNet(spconv), seed=7).double().eval()
    model.down1[1].train()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    converted = cst.from_spconv(model)
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in before.items())
    assert isinstance(model.stem[0], spconv.SubMConv3d) and model.up1.indice_key == "down1"
    batch_norm = converted.down1[1]
    assert isinstance(batch_norm, cst.SparseBatchNorm) and batch_norm.training
    assert not converted.down1.training and not converted.down1[0].training and not converted.training
    for name in ("running_mean", "running_var", "weight", "bias", "num_batches_tracked"):
        assert torch.equal(getattr(batch_norm, name), getattr(model.down1[1], name)), name
    assert batch_norm.eps == model.down1[1].eps and batch_norm.weight.dtype == torch.float64
    stem = converted.stem[0]
    assert (stem.indice_key, stem.kernel_size, stem.weight.dtype) == ("subm0", (3, 3, 3), torch.float64)
    their_weight = model.stem[0].weight.detach()  # [C_out, kz, ky, kx, C_in]
    assert torch.equal(stem.weight[5], their_weight[:, 0, 1, 2, :].T)  # offset (-1, 0, 1): kernel index (0, 1, 2)
    assert torch.equal(converted.head.weight[0], model.head.weight.detach().reshape(16, 5))  # spconv's conv1x1 view
    assert (converted.down1[0].padding, converted.down2[0].padding) == ((1, 1, 1), (0, 0, 0))
    assert converted.up2[0].inverts == "down2"


def test_what_cannot_be_converted_is_named_with_its_path_and_type(spconv):
    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = spconv.SparseSequential(spconv.SubMConv3d(4, 8, 3), spconv.SparseMaxPool3d(2, 2))
            self.head = nn.Sequential(nn.Linear(8, 2), spconv.ToDense())
            self.plain = nn.Linear(8, 8)

    with pytest.raises(SpconvConversionError) as raised:
        cst.from_spconv(Backbone())
    message = str(raised.value)
    assert "encoder.1 (spconv.pytorch.pool.SparseMaxPool3d): no cupysparse counterpart" in message
    assert "head.1 (spconv.pytorch.ToDense): no cupysparse counterpart" in message
    assert "encoder.0" not in message and "plain" not in message
    with pytest.raises(SpconvConversionError, match=r"the model \(spconv.pytorch.conv.SparseConv4d\): 4D"):
        cst.from_spconv(spconv.SparseConv4d(2, 2, 3))


def test_tensors_convert_both_ways(spconv):
    coordinates = scene((9, 8, 7), 40, seed=8, items=3)
    features = torch.randn(len(coordinates), 5)
    theirs = spconv.SparseConvTensor(features, coordinates, [9, 8, 7], 3)
    ours = cst.from_spconv_tensor(theirs)
    assert torch.equal(ours.coordinates, coordinates) and ours.features is features
    assert ours.spatial_shape == (9, 8, 7) and ours.batch_size == 3
    back = cst.to_spconv_tensor(ours, batch_size=4)
    assert torch.equal(back.indices, coordinates) and back.features is features
    assert (back.spatial_shape, back.batch_size) == ([9, 8, 7], 4)
    with pytest.raises(ValueError, match="needs a spatial shape"):
        cst.to_spconv_tensor(cst.SparseTensor(coordinates, features))


# --- the torch modules without spconv: dense references -----------------------------------------------


def dense(tensor: cst.SparseTensor, shape) -> torch.Tensor:
    """`[B, C, *shape]` float64, zero where no voxel is."""
    out = torch.zeros((tensor.batch_size, tensor.features.shape[1], *shape), dtype=torch.float64)
    coordinates = tensor.coordinates.cpu()
    index = (coordinates[:, 0].long(), slice(None), *coordinates[:, 1:].long().T)
    out[index] = tensor.features.detach().cpu().double()
    return out


def active(coordinates: torch.Tensor, batch_size: int, shape) -> torch.Tensor:
    occupancy = torch.zeros((batch_size, 1, *shape), dtype=torch.float64)
    occupancy[(coordinates[:, 0].long(), 0, *coordinates[:, 1:].long().T)] = 1
    return occupancy


def read(dense_out: torch.Tensor, coordinates: torch.Tensor) -> np.ndarray:
    index = (coordinates[:, 0].long(), slice(None), *coordinates[:, 1:].long().T)
    return dense_out[index].numpy()


def reached(dense_occupancy: torch.Tensor) -> set:
    return {tuple(row) for row in torch.nonzero(dense_occupancy[:, 0] > 0).tolist()}


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize(("kernel_size", "stride", "dilation", "padding"),
                         [(3, 2, 1, 1), (3, 1, 1, 1), ((3, 2, 1), (2, 2, 1), (1, 2, 1), (0, 1, 0)), (2, 2, 1, 0)])
def test_a_padded_convolution_and_its_inverse_are_dense_convolutions_read_at_the_active_voxels(
        kernel_size, stride, dilation, padding, device):
    shape = (11, 10, 9)
    coordinates = scene(shape, 60, seed=9)
    x = cst.SparseTensor(coordinates.to(device), torch.randn(len(coordinates), 3, dtype=torch.float64,
                                                             device=device), spatial_shape=shape)
    down = cst.SparseConv3d(3, 4, kernel_size, stride, dilation, padding=padding, indice_key="down")
    up = cst.SparseInverseConv3d(4, 2, kernel_size, indice_key="down")
    down, up = down.to(device, torch.float64), up.to(device, torch.float64)
    y = down(x)
    z = up(y)
    geometry = {"stride": down.stride, "padding": down.padding, "dilation": down.dilation}
    our_weight = torch.from_numpy(to_torch_conv_weight(down.weight.detach().cpu().numpy(), down.kernel_size))
    expected = F.conv3d(dense(x, shape), our_weight, down.bias.detach().cpu(), **geometry)
    reach = F.conv3d(active(coordinates, 2, shape), torch.ones((1, 1, *down.kernel_size), dtype=torch.float64),
                     **geometry)
    assert {tuple(row) for row in y.coordinates.tolist()} == reached(reach)
    assert y.spatial_shape == tuple(reach.shape[2:]) and y.indice_keys["down"].padding == down.padding
    np.testing.assert_allclose(host(y.features), read(expected, y.coordinates.cpu()), rtol=1e-12, atol=1e-12)

    torch_weight = torch.from_numpy(np.ascontiguousarray(up.weight.detach().cpu().numpy().transpose(1, 2, 0)).reshape(
        4, 2, *up.kernel_size))  # `[C_in, C_out, *k]`: ConvTranspose's layout, W_k = w[:, :, k] (weight_layouts)
    full = F.conv_transpose3d(dense(y, y.spatial_shape), torch_weight, stride=down.stride, dilation=down.dilation)
    # Fine voxel x is full's index x + p; past full's end, no tap reaches (zeros).
    extra = [max(p + size - length, 0) for p, size, length in zip(down.padding, shape, full.shape[2:])]
    full = F.pad(full, [amount for axis in reversed(extra) for amount in (0, axis)])
    crop = full[(slice(None), slice(None), *(slice(p, p + size) for p, size in zip(down.padding, shape)))]
    assert torch.equal(z.coordinates.cpu(), coordinates) and z.spatial_shape == shape
    np.testing.assert_allclose(host(z.features), read(crop, coordinates) + host(up.bias), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_spconvs_transposed_convolution_is_a_dense_transposed_convolution(device):
    shape, fine_shape = (6, 5, 7), (11, 9, 13)  # (S - 1)·2 - 2 + 3
    coordinates = scene(shape, 30, seed=10)
    x = cst.SparseTensor(coordinates.to(device), torch.randn(len(coordinates), 3, dtype=torch.float64,
                                                             device=device), 2, spatial_shape=shape)
    conv = cst.SparseConvTranspose3d(3, 2, 3, 2, generative=True, padding=1).to(device, torch.float64)
    y = conv(x)
    torch_weight = torch.from_numpy(conv.weight.detach().cpu().numpy().transpose(1, 2, 0).reshape(3, 2, 3, 3, 3))
    expected = F.conv_transpose3d(dense(x, shape), torch_weight, conv.bias.detach().cpu(), stride=2, padding=1)
    reach = F.conv_transpose3d(active(coordinates, 2, shape), torch.ones((1, 1, 3, 3, 3), dtype=torch.float64),
                               stride=2, padding=1)
    assert expected.shape[2:] == fine_shape and y.spatial_shape == fine_shape and y.tensor_stride == (1, 1, 1)
    assert {tuple(row) for row in y.coordinates.tolist()} == reached(reach)
    np.testing.assert_allclose(host(y.features), read(expected, y.coordinates.cpu()), rtol=1e-12, atol=1e-12)


def sparse_input(shape=(9, 8, 7), channels: int = 2) -> cst.SparseTensor:
    coordinates = scene(shape, 40, seed=11)
    return cst.SparseTensor(coordinates, torch.randn(len(coordinates), channels), spatial_shape=shape)


def test_indice_keys_follow_spconvs_rules():
    x = sparse_input()
    subm = cst.SubMConv3d(2, 2, 3, indice_key="subm")(x)
    again = cst.SubMConv3d(2, 2, 3, indice_key="subm")(subm)  # a key shared by equal submanifold kernels
    assert again.indice_keys == subm.indice_keys and again.indice_keys["subm"].kind == "submanifold"
    with pytest.raises(ValueError, match=r"sharing indice_key 'subm' must share kernel size and dilation: "
                                         r"registered \(3, 3, 3\), \(1, 1, 1\); this one \(5, 5, 5\)"):
        cst.SubMConv3d(2, 2, 5, indice_key="subm")(subm)
    down = cst.SparseConv3d(2, 2, 3, 2, padding=1, indice_key="down")(subm)
    assert set(down.indice_keys) == {"subm", "down"} and "down" not in subm.indice_keys
    assert down.replace_feature(down.features * 2).indice_keys is down.indice_keys
    with pytest.raises(ValueError, match="indice_key 'down' is already registered on the input, by a forward"):
        cst.SparseConv3d(2, 2, 3, 2, padding=1, indice_key="down")(down)
    with pytest.raises(ValueError, match=r"no convolution registered indice_key 'up' on the way to this input "
                                         r"\(registered: \['down', 'subm'\]\)"):
        cst.SparseInverseConv3d(2, 2, 3, indice_key="up")(down)
    with pytest.raises(ValueError, match="inverts a strided or padded convolution; indice_key 'subm' was registered "
                                         "by a submanifold one"):
        cst.SparseInverseConv3d(2, 2, 3, indice_key="subm")(down)
    with pytest.raises(ValueError, match=r"has the kernel size of the convolution it inverts, \(3, 3, 3\) "
                                         r"\(indice_key 'down'\); this one has \(2, 2, 2\)"):
        cst.SparseInverseConv3d(2, 2, 2, indice_key="down")(down)


def test_an_unpadded_strided_convolution_is_inverted_through_its_key():
    x = sparse_input()
    conv = cst.SparseConv3d(2, 3, 2, 2, indice_key="down")
    inverse, transposed = cst.SparseInverseConv3d(3, 2, 2, indice_key="down"), cst.SparseConvTranspose3d(3, 2, 2, 2)
    transposed.load_state_dict(inverse.state_dict())
    y = conv(x)
    z = inverse(y)
    assert torch.equal(z.coordinates, x.coordinates) and torch.equal(z.features, transposed(y).features)


def test_the_modules_check_their_spconv_arguments():
    with pytest.raises(TypeError, match="takes no padding"):
        cst.SubMConv3d(2, 2, 3, padding=1)
    with pytest.raises(ValueError, match="padding must be non-negative"):
        cst.SparseConv3d(2, 2, 3, 2, padding=-1)
    with pytest.raises(TypeError, match=r"padding must be an int or 2 ints, got 1.5 \(float\)"):
        cst.SparseConv2d(2, 2, 3, 2, padding=1.5)
    with pytest.raises(TypeError, match=r"indice_key must be a str or None, got 3 \(int\)"):
        cst.SubMConv3d(2, 2, 3, indice_key=3)
    with pytest.raises(TypeError, match="needs the indice_key of the convolution it inverts"):
        cst.SparseInverseConv3d(2, 2, 3, None)
    module = cst.SparseConv3d(2, 2, 3, 2, padding=(1, 0, 1), indice_key="down")
    assert "padding=(1, 0, 1)" in repr(module) and "indice_key='down'" in repr(module)


def test_padded_convolutions_have_the_gradients_of_their_sums():
    """A padded strided convolution and its inverse, differentiated through their reversed maps (gradcheck)."""
    coordinates = scene((6, 5, 4), 12, seed=12)
    x = cst.SparseTensor(coordinates, torch.zeros(len(coordinates), 2, dtype=torch.float64), spatial_shape=(6, 5, 4))
    generator = torch.Generator().manual_seed(13)
    features, weight, back_weight = (torch.randn(shape, dtype=torch.float64, generator=generator, requires_grad=True)
                                     for shape in ((len(coordinates), 2), (27, 2, 3), (27, 3, 2)))

    def inverse_of_padded(features, weight, back_weight):
        coarse = cst.sparse_conv(x.replace_feature(features), weight, 3, 2, padding=1)
        return cst.sparse_conv(coarse, back_weight, 3, 2, transposed=True, padding=1).features

    assert torch.autograd.gradcheck(inverse_of_padded, (features, weight, back_weight))
