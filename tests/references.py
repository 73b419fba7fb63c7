"""Dense NumPy references for sparse convolutions, independent of the library's kernel maps.

Features are scattered into a dense grid `[B, *shape, C]` (zeros where no voxel is), the dense
convolution is computed over the whole grid with shifted, strided slices, and the result is read
at the active output sites. Coordinates are absolute, in units of each tensor's own stride.

With `o_k` the kernel offsets (lexicographic, d0 slowest; -r..r for odd sizes, even sizes lean
positive), a strided (or submanifold, stride 1) convolution is
    out[q] = Σ_k W_k^T · x[q·stride + dilation·o_k]
and a transposed one scatters each coarse site the other way:
    out[q·stride + dilation·o_k] += W_k^T · x[q].
The gradients are the adjoints of these linear maps, written out the same way.
"""

from __future__ import annotations

import itertools

import numpy as np


def offsets(kernel_size) -> np.ndarray:
    axes = [range(-((s - 1) // 2), s // 2 + 1) for s in kernel_size]
    return np.array(list(itertools.product(*axes)), dtype=np.int64).reshape(-1, len(kernel_size))


class Grid:
    """A dense box `[B, *shape, C]` whose index 0 holds absolute coordinate `origin`."""

    def __init__(self, batch_size: int, origin, shape):
        self.batch_size = batch_size
        self.origin = np.asarray(origin, dtype=np.int64)
        self.shape = tuple(int(s) for s in shape)

    @classmethod
    def covering(cls, batch_size: int, *coordinate_sets, margin: int = 0) -> Grid:
        spatial = np.concatenate([np.asarray(c, dtype=np.int64)[:, 1:] for c in coordinate_sets if len(c)])
        low = spatial.min(axis=0) - margin
        high = spatial.max(axis=0) + margin
        return cls(batch_size, low, high - low + 1)

    def index(self, coords) -> tuple:
        coords = np.asarray(coords, dtype=np.int64)
        local = coords[:, 1:] - self.origin
        assert (local >= 0).all() and (local < np.array(self.shape)).all(), "coordinates outside the grid"
        return (coords[:, 0], *local.T)

    def scatter(self, coords, features) -> np.ndarray:
        dense = np.zeros((self.batch_size, *self.shape, features.shape[1]), dtype=np.float64)
        dense[self.index(coords)] = features
        return dense

    def read(self, dense, coords) -> np.ndarray:
        return dense[self.index(coords)]


def _axis_indices(fine: Grid, coarse: Grid, stride, shift) -> tuple[list, np.ndarray]:
    """Per axis, the fine index of every coarse index q (`q·stride + shift`), clipped, with the valid mask."""
    indices, valid = [], np.ones(coarse.shape, dtype=bool)
    for axis, size in enumerate(coarse.shape):
        absolute = (coarse.origin[axis] + np.arange(size)) * stride[axis] + shift[axis]
        local = absolute - fine.origin[axis]
        inside = (local >= 0) & (local < fine.shape[axis])
        indices.append(np.clip(local, 0, fine.shape[axis] - 1))
        valid &= inside.reshape([-1 if a == axis else 1 for a in range(len(coarse.shape))])
    return indices, valid


def _views(fine: Grid, coarse: Grid, kernel_size, stride, dilation):
    """For each offset k: (k, index tuple into the fine grid for every coarse site, valid mask)."""
    for k, offset in enumerate(offsets(kernel_size)):
        indices, valid = _axis_indices(fine, coarse, stride, np.asarray(dilation) * offset)
        yield k, (slice(None), *np.ix_(*indices)), valid[None, ..., None]


def conv_gather(x_fine, fine: Grid, coarse: Grid, weight, kernel_size, stride, dilation):
    """Dense `out[q] = Σ_k W_k^T x[q·stride + dilation·o_k]` over every site q of `coarse`."""
    out = np.zeros((coarse.batch_size, *coarse.shape, weight.shape[2]))
    for k, index, valid in _views(fine, coarse, kernel_size, stride, dilation):
        out += np.where(valid, x_fine[index], 0) @ weight[k]
    return out


def conv_scatter(y_coarse, fine: Grid, coarse: Grid, weight, kernel_size, stride, dilation):
    """Dense `out[q·stride + dilation·o_k] += W_k y[q]`: the adjoint of `conv_gather` in x."""
    out = np.zeros((fine.batch_size, *fine.shape, weight.shape[1]))
    for k, index, valid in _views(fine, coarse, kernel_size, stride, dilation):
        np.add.at(out, index, np.where(valid, y_coarse @ weight[k].T, 0))  # clipped indices repeat
    return out


def conv_weight_grad(x_fine, y_coarse, fine: Grid, coarse: Grid, kernel_size, stride, dilation):
    """`dW_k = Σ_q x[q·stride + dilation·o_k]^T y[q]`: the adjoint of `conv_gather` in W."""
    num_offsets = len(offsets(kernel_size))
    grad = np.zeros((num_offsets, x_fine.shape[-1], y_coarse.shape[-1]))
    for k, index, valid in _views(fine, coarse, kernel_size, stride, dilation):
        gathered = np.where(valid, x_fine[index], 0)
        grad[k] = gathered.reshape(-1, x_fine.shape[-1]).T @ y_coarse.reshape(-1, y_coarse.shape[-1])
    return grad


def depthwise_gather(x_fine, fine: Grid, coarse: Grid, weight, kernel_size, stride, dilation):
    """Dense depthwise `out[q, c] = Σ_k w[k, c] x[q·stride + dilation·o_k, c]`."""
    out = np.zeros((coarse.batch_size, *coarse.shape, weight.shape[1]))
    for k, index, valid in _views(fine, coarse, kernel_size, stride, dilation):
        out += np.where(valid, x_fine[index], 0) * weight[k]
    return out


def depthwise_scatter(y_coarse, fine: Grid, coarse: Grid, weight, kernel_size, stride, dilation):
    out = np.zeros((fine.batch_size, *fine.shape, weight.shape[1]))
    for k, index, valid in _views(fine, coarse, kernel_size, stride, dilation):
        np.add.at(out, index, np.where(valid, y_coarse * weight[k], 0))
    return out


def depthwise_weight_grad(x_fine, y_coarse, fine: Grid, coarse: Grid, kernel_size, stride, dilation):
    grad = np.zeros((len(offsets(kernel_size)), x_fine.shape[-1]))
    for k, index, valid in _views(fine, coarse, kernel_size, stride, dilation):
        grad[k] = (np.where(valid, x_fine[index], 0) * y_coarse).reshape(-1, x_fine.shape[-1]).sum(axis=0)
    return grad
