"""`load_spconv_state_dict` on checkpoints written by hand in spconv 2.x's layouts (no spconv needed):
the loaded model computes what those weights mean to spconv (brute-force references in NumPy, written
from spconv's definitions), and every mismatch is an error naming the layer and both shapes."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.networks.weight_layouts import from_spconv_weight  # noqa: E402


def sparse_input(channels: int, dims: int = 3, seed: int = 0) -> "cst.SparseTensor":
    rng = np.random.default_rng(seed)
    items = []
    for batch in range(2):
        unique = np.unique(rng.integers(-4, 4, (60, dims)), axis=0)
        items.append(np.concatenate([np.full((len(unique), 1), batch), unique], axis=1))
    coordinates = torch.from_numpy(np.concatenate(items).astype(np.int32))
    features = torch.from_numpy(rng.standard_normal((len(coordinates), channels)))
    return cst.SparseTensor(coordinates, features)


def checkpoint_tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape))


def as_rows(tensor: "cst.SparseTensor") -> dict[tuple, np.ndarray]:
    """Each voxel's features by its coordinates (batch first), so that outputs compare in any order."""
    coordinates = tensor.coordinates.numpy()
    features = tensor.features.detach().numpy()
    return {tuple(int(c) for c in row): features[i] for i, row in enumerate(coordinates)}


def tap(weight: np.ndarray, offset_index: tuple) -> np.ndarray:
    """spconv's `[C_out, C_in]` matrix of one kernel position of its `[C_out, *k, C_in]` weight."""
    return weight[(slice(None), *offset_index, slice(None))]


def submanifold_reference(rows: dict, weight: np.ndarray, bias: np.ndarray) -> dict:
    """spconv's SubMConv: at each input voxel p, `bias + Σ_d w[:, d, :] · in[p + d - (k - 1) // 2]`."""
    kernel = weight.shape[1:-1]
    out = {}
    for voxel in rows:
        total = bias.copy()
        for offset_index in np.ndindex(*kernel):
            neighbour = (voxel[0], *(x + d - (k - 1) // 2 for x, d, k in zip(voxel[1:], offset_index, kernel)))
            if neighbour in rows:
                total += tap(weight, offset_index) @ rows[neighbour]
        out[voxel] = total
    return out


def strided_reference(rows: dict, weight: np.ndarray, bias: np.ndarray) -> dict:
    """spconv's SparseConv of kernel 2, stride 2, padding 0: `out[q] = bias + Σ_d w[:, d, :] · in[2q + d]`."""
    out = {}
    for voxel, features in rows.items():
        coarse = (voxel[0], *(x // 2 for x in voxel[1:]))
        offset_index = tuple(x - 2 * q for x, q in zip(voxel[1:], coarse[1:]))
        out[coarse] = out.get(coarse, bias.copy()) + tap(weight, offset_index) @ features
    return out


def inverse_reference(coarse_rows: dict, fine_voxels, weight: np.ndarray, bias: np.ndarray) -> dict:
    """spconv's SparseInverseConv of that strided one, back onto its input voxels:
    `out[f] = bias + w[:, f - 2q, :] · in[q]`, q = floor(f / 2)."""
    out = {}
    for voxel in fine_voxels:
        coarse = (voxel[0], *(x // 2 for x in voxel[1:]))
        offset_index = tuple(x - 2 * q for x, q in zip(voxel[1:], coarse[1:]))
        out[voxel] = bias + tap(weight, offset_index) @ coarse_rows[coarse]
    return out


def assert_rows_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for voxel, features in expected.items():
        np.testing.assert_allclose(actual[voxel], features, rtol=1e-6, atol=1e-6)


def test_a_network_computes_what_its_spconv_checkpoint_means():
    """Submanifold (anisotropic kernel, so the kernel axes must meet the right coordinate columns), batch
    norm, strided, inverse and 1x1x1 convolutions, each against spconv's definition."""
    model = torch.nn.Sequential(
        cst.SubMConv3d(4, 6, (1, 3, 5)), cst.SparseBatchNorm(6), cst.SparseConv3d(6, 5, 2, stride=2),
        cst.SparseConvTranspose3d(5, 3, 2, stride=2), cst.SubMConv3d(3, 2, 1),
    ).double().eval()
    checkpoint = {
        "0.weight": checkpoint_tensor(6, 1, 3, 5, 4, seed=1), "0.bias": checkpoint_tensor(6, seed=2),
        "1.weight": checkpoint_tensor(6, seed=3), "1.bias": checkpoint_tensor(6, seed=4),
        "1.running_mean": checkpoint_tensor(6, seed=5), "1.running_var": 0.5 + checkpoint_tensor(6, seed=6) ** 2,
        "1.num_batches_tracked": torch.tensor(7),
        "2.weight": checkpoint_tensor(5, 2, 2, 2, 6, seed=7), "2.bias": checkpoint_tensor(5, seed=8),
        "3.weight": checkpoint_tensor(3, 2, 2, 2, 5, seed=9), "3.bias": checkpoint_tensor(3, seed=10),
        "4.weight": checkpoint_tensor(2, 1, 1, 1, 3, seed=11), "4.bias": checkpoint_tensor(2, seed=12),
    }
    assert cst.load_spconv_state_dict(model, checkpoint) == ["0", "1", "2", "3", "4"]
    spconv = {key: value.numpy() for key, value in checkpoint.items()}

    x = sparse_input(4)
    with torch.no_grad():
        submanifold = model[0](x)
        normalised = model[1](submanifold)
        down = model[2](normalised)
        up = model[3](down)
        out = model[4](up)
    expected = submanifold_reference(as_rows(x), spconv["0.weight"], spconv["0.bias"])
    assert_rows_close(as_rows(submanifold), expected)
    scale = spconv["1.weight"] / np.sqrt(spconv["1.running_var"] + model[1].eps)
    expected = {voxel: (features - spconv["1.running_mean"]) * scale + spconv["1.bias"]
                for voxel, features in expected.items()}
    assert_rows_close(as_rows(normalised), expected)
    assert int(model[1].num_batches_tracked) == 7
    expected = strided_reference(expected, spconv["2.weight"], spconv["2.bias"])
    assert_rows_close(as_rows(down), expected)
    expected = inverse_reference(expected, as_rows(x).keys(), spconv["3.weight"], spconv["3.bias"])
    assert_rows_close(as_rows(up), expected)
    # spconv runs a 1x1x1 convolution as `features @ weight.view(C_in, C_out)` (its issue #450).
    matrix = spconv["4.weight"].reshape(3, 2)
    expected = {voxel: features @ matrix + spconv["4.bias"] for voxel, features in expected.items()}
    assert_rows_close(as_rows(out), expected)


def test_weights_are_the_layout_converters():
    """The loader and `weight_layouts.from_spconv_weight` agree, in 2D too."""
    model = torch.nn.Sequential(cst.SubMConv2d(3, 4, (3, 5)), cst.SparseConv3d(4, 2, (2, 1, 3), stride=2)).double()
    checkpoint = {"0.weight": checkpoint_tensor(4, 3, 5, 3, seed=1), "0.bias": checkpoint_tensor(4, seed=2),
                  "1.weight": checkpoint_tensor(2, 2, 1, 3, 4, seed=3), "1.bias": checkpoint_tensor(2, seed=4)}
    cst.load_spconv_state_dict(model, checkpoint)
    for index in range(2):
        expected = from_spconv_weight(checkpoint[f"{index}.weight"].numpy())
        np.testing.assert_array_equal(model[index].weight.detach().numpy(), expected)

    x = sparse_input(3, dims=2)
    spconv = {key: value.numpy() for key, value in checkpoint.items()}
    with torch.no_grad():
        actual = as_rows(model[0](x))
    assert_rows_close(actual, submanifold_reference(as_rows(x), spconv["0.weight"], spconv["0.bias"]))


def conv_and_norm(bias: bool = True) -> torch.nn.Module:
    return torch.nn.Sequential(cst.SubMConv3d(4, 6, 3, bias=bias), cst.SparseBatchNorm(6)).double()


def full_checkpoint() -> dict:
    return {"0.weight": checkpoint_tensor(6, 3, 3, 3, 4, seed=1), "0.bias": checkpoint_tensor(6, seed=2),
            "1.weight": checkpoint_tensor(6, seed=3), "1.bias": checkpoint_tensor(6, seed=4),
            "1.running_mean": checkpoint_tensor(6, seed=5), "1.running_var": checkpoint_tensor(6, seed=6) ** 2,
            "1.num_batches_tracked": torch.tensor(3)}


# One test per shortcoming of the first version (issue 44): each fails on it.

def test_batch_norms_load():
    model = conv_and_norm()
    checkpoint = full_checkpoint()
    cst.load_spconv_state_dict(model, checkpoint)
    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model[1], name).detach(), checkpoint[f"1.{name}"], rtol=0, atol=0)


def test_a_batch_norm_missing_from_the_checkpoint_is_an_error():
    checkpoint = full_checkpoint()
    del checkpoint["1.running_var"]
    with pytest.raises(KeyError, match=r"SparseBatchNorm '1'.*'1\.running_var'.*\(6,\)"):
        cst.load_spconv_state_dict(conv_and_norm(), checkpoint)


def test_checkpoint_keys_no_module_takes_are_an_error_listing_them():
    checkpoint = full_checkpoint()
    checkpoint["head.weight"] = checkpoint_tensor(2, 6, seed=7)
    checkpoint["backbone.0.weight"] = checkpoint["0.weight"]
    with pytest.raises(KeyError) as error:
        cst.load_spconv_state_dict(conv_and_norm(), checkpoint)
    message = str(error.value)
    assert "head.weight: no module of the model is named 'head'" in message and "(2, 6)" in message
    assert "backbone.0.weight: no module of the model is named 'backbone.0'" in message


def test_a_checkpoint_bias_for_a_module_without_one_is_an_error():
    with pytest.raises(KeyError, match=r"SubMConv3d '0'.*'0\.bias' has shape \(6,\).*no 'bias'"):
        cst.load_spconv_state_dict(conv_and_norm(bias=False), full_checkpoint())


def test_a_module_bias_the_checkpoint_lacks_is_an_error():
    checkpoint = full_checkpoint()
    del checkpoint["0.bias"]
    with pytest.raises(KeyError, match=r"SubMConv3d '0'.*no '0\.bias'.*\(6,\)"):
        cst.load_spconv_state_dict(conv_and_norm(), checkpoint)


@pytest.mark.parametrize("shape", [(6, 1, 3, 9, 4), (4, 3, 3, 3, 6), (6, 27, 4)])
def test_a_weight_must_have_spconvs_exact_shape(shape):
    """A (1, 3, 9) kernel has a 3x3x3 kernel's element count; swapped channels or a flat kernel axis too."""
    checkpoint = full_checkpoint()
    checkpoint["0.weight"] = checkpoint_tensor(*shape, seed=1)
    expected = rf"SubMConv3d '0'.*{re.escape(str(shape))}.*\(6, 3, 3, 3, 4\)"
    with pytest.raises(ValueError, match=expected):
        cst.load_spconv_state_dict(conv_and_norm(), checkpoint)


def test_a_1x1x1_weight_is_read_as_spconv_reads_it():
    model = torch.nn.Sequential(cst.SubMConv3d(3, 2, 1, bias=False)).double()
    weight = checkpoint_tensor(2, 1, 1, 1, 3, seed=1)
    cst.load_spconv_state_dict(model, {"0.weight": weight})
    torch.testing.assert_close(model[0].weight.detach(), weight.reshape(1, 3, 2), rtol=0, atol=0)


def test_a_failed_strict_load_changes_nothing_and_lists_every_problem():
    model = conv_and_norm()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    checkpoint = full_checkpoint()
    checkpoint["1.running_mean"] = checkpoint_tensor(7, seed=5)
    del checkpoint["1.running_var"]
    with pytest.raises(ValueError) as error:
        cst.load_spconv_state_dict(model, checkpoint)
    assert "'1.running_mean' has shape (7,), the module needs (6,)" in str(error.value)
    assert "no '1.running_var'" in str(error.value)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_a_non_strict_load_takes_what_fits_and_reports_the_rest():
    model = conv_and_norm(bias=False)
    checkpoint = full_checkpoint()
    checkpoint["1.running_mean"] = checkpoint_tensor(7, seed=5)
    checkpoint["head.weight"] = checkpoint_tensor(2, 6, seed=7)
    with pytest.warns(UserWarning, match="skipped 3 key"):
        loaded = cst.load_spconv_state_dict(model, checkpoint, strict=False)
    assert loaded == ["0", "1"]
    assert sorted(loaded.skipped) == ["0.bias", "1.running_mean", "head.weight"]
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), from_spconv_weight(checkpoint["0.weight"].numpy()))
    torch.testing.assert_close(model[1].running_var, checkpoint["1.running_var"], rtol=0, atol=0)
    assert not torch.equal(model[1].running_mean, checkpoint["1.running_mean"][:6])
