"""Loading an spconv 2.x checkpoint into a model of this adapter's modules: `load_spconv_state_dict`.

Names: there is no mapping. A checkpoint key is the model's own state-dict key, the module's path and
the tensor's name (`encoder.0.weight`), so the model must name its modules as the spconv model did
(`nn.Sequential` indices where spconv had a `SparseSequential`, the same attribute names elsewhere).

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

import math
import warnings

import torch
from torch import nn

from cupysparse.adapters.torch.convolution import SpatiallySparseConv


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
