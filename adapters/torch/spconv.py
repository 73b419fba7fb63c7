"""spconv 2.x models and tensors in this adapter: `from_spconv` converts a whole model (its modules, with
their geometry, weights, batch-norm statistics and indice keys), `from_spconv_tensor` / `to_spconv_tensor` its
`SparseConvTensor` (the same columns: batch, then spconv's z, y, x as our coordinate columns 1..D), and
`load_spconv_state_dict` loads an spconv checkpoint into a model built of this adapter's modules.

Names (`load_spconv_state_dict`): there is no mapping. A checkpoint key is the model's own state-dict key,
the module's path and the tensor's name (`encoder.0.weight`), so the model must name its modules as the
spconv model did (`nn.Sequential` indices where spconv had a `SparseSequential`, the same attribute names
elsewhere), as `from_spconv` does; its convolutions need spconv's padding where spconv's have one.

Layouts: a convolution's weight is spconv's `[C_out, *kernel_size, C_in]`, which must match the module's
kernel size and channels exactly, and becomes ours `[K, C_in, C_out]` as in
`cupysparse.networks.weight_layouts.from_spconv_weight`. The exception is the convolution spconv runs as
a matrix product (its `conv1x1`: kernel volume 1, stride 1), `features @ weight.view(C_in, C_out)` on
that same `[C_out, 1, 1, 1, C_in]` tensor (spconv issue #450): its memory is the `[C_in, C_out]`
matrix, and is loaded as such. Every other tensor has torch's layout on both sides and is copied as it
is, its shape checked: batch norms (`nn.BatchNorm1d`'s weight, bias, running_mean, running_var and
num_batches_tracked, the keys `SparseBatchNorm` keeps) and any plain torch module.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict

import torch
from torch import nn

from cupysparse.adapters.torch import convolution
from cupysparse.adapters.torch.convolution import SpatiallySparseConv
from cupysparse.adapters.torch.pointwise import PerVoxel, SparseBatchNorm, SparseReLU
from cupysparse.adapters.torch.tensor import SparseTensor, require_sparse


class SpconvCheckpointError(KeyError, ValueError):
    """A checkpoint that does not fit the model, every problem listed: a KeyError for keys missing or
    left over, a ValueError for shapes, so that callers catching either see it."""

    __str__ = ValueError.__str__  # KeyError's would print the message's repr, newlines escaped


class LoadedModules(list):
    """The names of the modules that took tensors from the checkpoint, in the model's order; `skipped`
    maps each key left out (the model's or the checkpoint's) to why."""

    def __init__(self, names: list[str], skipped: dict[str, str]):
        super().__init__(names)
        self.skipped = skipped


def spconv_weight_shape(conv: SpatiallySparseConv) -> tuple[int, ...]:
    """The shape spconv gives this convolution's weight: `[C_out, *kernel_size, C_in]`."""
    return (conv.out_channels, *conv.kernel_size, conv.in_channels)


def runs_as_matrix_product(conv: SpatiallySparseConv) -> bool:
    """Whether spconv computes this convolution as `features @ weight.view(C_in, C_out)`: its `conv1x1`,
    a kernel volume of 1 with stride 1 (a submanifold convolution's stride is 1)."""
    return math.prod(conv.kernel_size) == 1 and all(step == 1 for step in conv.stride)


def from_spconv_layout(weight: torch.Tensor, conv: SpatiallySparseConv) -> torch.Tensor:
    """spconv's weight of `conv` as ours, `[K, C_in, C_out]`. In torch rather than through
    `from_spconv_weight`'s NumPy, so that any dtype (bfloat16) on any device loads."""
    if runs_as_matrix_product(conv):
        return weight.reshape(1, conv.in_channels, conv.out_channels)
    return weight.reshape(conv.out_channels, -1, conv.in_channels).permute(1, 2, 0)


def _describe(name: str, module: nn.Module) -> str:
    layer = f"{type(module).__name__} {name!r}" if name else f"the model ({type(module).__name__})"
    if isinstance(module, SpatiallySparseConv):
        layer += f" (kernel {module.kernel_size}, {module.in_channels} -> {module.out_channels} channels)"
    return layer


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def load_spconv_state_dict(model: nn.Module, state_dict: dict, strict: bool = True) -> LoadedModules:
    """Load an spconv 2.x checkpoint into `model`: convolution weights converted from spconv's layout,
    biases, batch norms and any other tensor under the model's own key (see the module's docstring for
    names and layouts).

    With `strict` every tensor of the model must come from the checkpoint and every key of the
    checkpoint must go into the model, with its exact shape: otherwise a `SpconvCheckpointError` (a
    KeyError and a ValueError) lists every problem, each layer named with both shapes, and the model is
    left unchanged. Without, what fits is loaded and the rest is skipped, with a warning. Either way it
    returns the names of the modules loaded, a list whose `skipped` maps each key left out to why."""
    modules = dict(model.named_modules(remove_duplicate=False))
    targets = model.state_dict(keep_vars=True)  # the parameters and buffers themselves, by key
    problems: dict[str, str] = {}
    ready: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (the model's tensor, its new value)
    for key, target in targets.items():
        name, _, tensor_name = key.rpartition(".")
        module = modules[name]
        is_conv = isinstance(module, SpatiallySparseConv)
        if key not in state_dict:
            hint = " (an spconv layer without one: build this one with bias=False)" if is_conv else ""
            problems[key] = (f"{_describe(name, module)}: the checkpoint has no {key!r}; the module's "
                             f"{tensor_name} has shape {_shape(target)}{hint}")
            continue
        value = torch.as_tensor(state_dict[key])
        is_conv_weight = is_conv and tensor_name == "weight"
        expected = spconv_weight_shape(module) if is_conv_weight else _shape(target)
        if _shape(value) != expected:
            layout = " (spconv's [C_out, *kernel_size, C_in])" if is_conv_weight else ""
            problems[key] = (f"{_describe(name, module)}: the checkpoint's {key!r} has shape {_shape(value)}, "
                             f"the module needs {expected}{layout}")
            continue
        ready[key] = (target, from_spconv_layout(value, module) if is_conv_weight else value)
    for key in state_dict:
        if key in targets:
            continue
        name, _, tensor_name = key.rpartition(".")
        shape = _shape(torch.as_tensor(state_dict[key]))
        if name not in modules:
            problems[key] = (f"no module of the model is named {name!r} (checkpoint keys are the model's own "
                             f"state-dict keys); the checkpoint's tensor has shape {shape}")
            continue
        hint = " (build it with bias=True)" if isinstance(modules[name], SpatiallySparseConv) else ""
        problems[key] = (f"{_describe(name, modules[name])}: the checkpoint's {key!r} has shape {shape}, but "
                         f"the module has no {tensor_name!r}{hint}")
    if problems:
        report = "\n".join(f"  {key}: {why}" for key, why in problems.items())
        if strict:
            raise SpconvCheckpointError(f"the spconv checkpoint does not fit the model; nothing was loaded:\n{report}")
        warnings.warn(f"load_spconv_state_dict skipped {len(problems)} key(s):\n{report}", stacklevel=2)
    with torch.no_grad():
        for target, value in ready.values():
            target.copy_(value)
    loaded = dict.fromkeys(key.rpartition(".")[0] for key in ready)
    return LoadedModules(list(loaded), problems)


class SpconvConversionError(TypeError):
    """Modules of an spconv model that `from_spconv` cannot convert, each named with its path and type."""


def from_spconv_tensor(tensor) -> SparseTensor:
    """spconv's `SparseConvTensor` as this adapter's `SparseTensor`, sharing its memory where it can: the same
    features, its indices as the coordinates (column 0 the batch index, then spconv's spatial axes in its own
    order, z, y, x, which are our coordinate columns 1..D as they are) and its spatial shape, all checked."""
    return SparseTensor(tensor.indices.int(), tensor.features,
                        spatial_shape=tuple(int(size) for size in tensor.spatial_shape))


def to_spconv_tensor(tensor: SparseTensor, batch_size: int | None = None):
    """This adapter's `SparseTensor` as spconv's `SparseConvTensor` (the inverse of `from_spconv_tensor`), with
    `batch_size` items (default: the largest batch index + 1); the tensor needs a spatial shape."""
    require_sparse(tensor)
    if tensor.spatial_shape is None:
        raise ValueError("spconv's SparseConvTensor needs a spatial shape: build the tensor with spatial_shape=...")
    spconv = _import_spconv()
    return spconv.SparseConvTensor(tensor.features, tensor.coordinates, list(tensor.spatial_shape),
                                   tensor.batch_size if batch_size is None else batch_size)


def from_spconv(module: nn.Module) -> nn.Module:
    """An equivalent model of this adapter's modules for an spconv 2.x model, with its weights, biases and
    batch-norm statistics, in its training mode, on its device and in its dtype: the same outputs for the same
    input (`from_spconv_tensor`).

    Converted: spconv's `SubMConv2d/3d`, `SparseConv2d/3d` (its padding and geometry: `padding`),
    `SparseInverseConv2d/3d`, `SparseConvTranspose2d/3d`, all with their indice keys; a `SparseSequential` becomes
    an `nn.Sequential` whose `nn.BatchNorm1d` and `nn.ReLU` are `SparseBatchNorm` and `SparseReLU`, and whose
    other torch modules, which spconv applies to the features, are wrapped in `PerVoxel`. Any other module is a
    container: a copy of it (its own class and forward) with its children converted, its torch layers kept as
    they are, for its forward applies them itself. An spconv module of any other kind (pooling, `ToDense`,
    1D/4D convolutions, fused activations) raises a `SpconvConversionError` listing every such module by path and
    type; nothing is converted then.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    spconv = _import_spconv()
    problems: list[str] = []
    converted = _Converter(spconv, problems).convert(module, "")
    if problems:
        raise SpconvConversionError("from_spconv cannot convert:\n" + "\n".join(f"  {line}" for line in problems))
    return converted


def _import_spconv():
    try:
        import spconv.pytorch as spconv
    except ImportError as error:
        raise ImportError(f"converting from spconv needs spconv 2.x installed (spconv.pytorch): {error}") from error
    return spconv


def _type_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


class _Converter:
    def __init__(self, spconv, problems: list[str]):
        self.spconv = spconv
        self.problems = problems

    def fail(self, path: str, module: nn.Module, why: str) -> nn.Module:
        self.problems.append(f"{path or 'the model'} ({_type_name(module)}): {why}")
        return module

    def is_spconv(self, module: nn.Module) -> bool:
        return type(module).__module__.split(".")[0] == "spconv"

    def convert(self, module: nn.Module, path: str) -> nn.Module:
        """`module` where its parent hands it the sparse tensor (the model itself, a container's child, a
        SparseSequential's spconv module)."""
        if isinstance(module, self.spconv.conv.SparseConvolution):
            return self.sparse_convolution(module, path)
        if isinstance(module, self.spconv.SparseSequential):
            return _in_mode_of(module, nn.Sequential(OrderedDict((name, self.element(child, _child_path(path, name)))
                                                                 for name, child in module.named_children())))
        if self.is_spconv(module):
            if isinstance(module, nn.BatchNorm1d):  # spconv's SparseBatchNorm and SparseReLU take sparse tensors
                return _batch_norm(module)
            if isinstance(module, nn.ReLU):
                return _relu(module)
            return self.fail(path, module, "no cupysparse counterpart")
        return self.container(module, path)

    def element(self, module: nn.Module, path: str) -> nn.Module:
        """A SparseSequential's `module`: spconv's own modules take the sparse tensor, the others its features."""
        if self.is_spconv(module) or isinstance(module, self.spconv.SparseModule):
            return self.convert(module, path)
        if type(module) is nn.BatchNorm1d:
            return _batch_norm(module)
        if type(module) is nn.ReLU:
            return _relu(module)
        inner = next((name for name, child in module.named_modules() if self.is_spconv(child)), None)
        if inner is not None:
            return self.fail(path, module, f"SparseSequential applies it to the features, yet it holds spconv's "
                                           f"{_child_path(path, inner)}")
        return _in_mode_of(module, PerVoxel(copy.deepcopy(module)))

    def container(self, module: nn.Module, path: str) -> nn.Module:
        """A copy of `module` (its class, attributes and forward) with its children converted."""
        memo = {}
        for name, child in module.named_children():
            child_path = _child_path(path, name)
            has_spconv = any(self.is_spconv(inner) for inner in child.modules())
            if self.is_spconv(child) or isinstance(child, self.spconv.SparseModule):
                memo[id(child)] = self.convert(child, child_path)
            elif has_spconv:
                memo[id(child)] = self.container(child, child_path)
        return copy.deepcopy(module, memo)  # the children converted above come out of `memo` as they are

    def sparse_convolution(self, module, path: str) -> nn.Module:
        if module.ndim not in (2, 3):
            return self.fail(path, module, f"{module.ndim}D convolutions: cupysparse has 2D and 3D")
        if module.act_type != type(module.act_type).None_:
            return self.fail(path, module, f"a fused activation ({module.act_type})")
        if module.transposed and any(module.output_padding):
            return self.fail(path, module, f"an output padding ({module.output_padding})")
        if module.inverse and module.conv1x1:
            return self.fail(path, module, "an inverse convolution of kernel volume 1, which spconv runs as a matrix "
                                           "product on its input's coordinates")
        shape = (module.out_channels, *module.kernel_size, module.in_channels)
        if tuple(module.weight.shape) != shape:
            return self.fail(path, module, f"a weight of shape {tuple(module.weight.shape)}, not spconv's "
                                           f"[C_out, *kernel_size, C_in] {shape}")
        suffix = f"{module.ndim}d"
        channels = (module.in_channels, module.out_channels, module.kernel_size)
        options = {"bias": module.bias is not None, "device": module.weight.device, "dtype": module.weight.dtype}
        if module.subm:
            ours = getattr(convolution, f"SubMConv{suffix}")(*channels, module.dilation, indice_key=module.indice_key,
                                                             **options)
        elif module.inverse:
            ours = getattr(convolution, f"SparseInverseConv{suffix}")(*channels, module.indice_key, **options)
        elif module.transposed:
            ours = getattr(convolution, f"SparseConvTranspose{suffix}")(
                *channels, module.stride, module.dilation, generative=True, padding=module.padding,
                indice_key=module.indice_key, **options)
        else:
            ours = getattr(convolution, f"SparseConv{suffix}")(*channels, module.stride, module.dilation,
                                                               padding=module.padding, indice_key=module.indice_key,
                                                               **options)
        with torch.no_grad():
            ours.weight.copy_(from_spconv_layout(module.weight.detach(), ours))
            if module.bias is not None:
                ours.bias.copy_(module.bias)
        return ours.train(module.training)


def _child_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _in_mode_of(module: nn.Module, wrapper: nn.Module) -> nn.Module:
    """`wrapper` with `module`'s training flag, its children keeping their own (`train()` would set theirs)."""
    wrapper.training = module.training
    return wrapper


def _batch_norm(module: nn.BatchNorm1d) -> SparseBatchNorm:
    ours = SparseBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                           module.track_running_stats)
    tensors = [*module.parameters(), *(buffer for buffer in module.buffers() if buffer.is_floating_point())]
    if tensors:
        ours.to(tensors[0].device, tensors[0].dtype)
    ours.load_state_dict(module.state_dict())
    return ours.train(module.training)


def _relu(module: nn.ReLU) -> SparseReLU:
    return SparseReLU(module.inplace).train(module.training)
