"""The reference networks (`cupysparse.networks.descriptions`) as `torch.nn` modules, and their weight files.

    model = MinkUNet18(in_channels=3, num_classes=13).cuda().half()
    logits = model(sparse_tensor).features                        # [N, 13]
    save_weights(model, "minkunet18.safetensors")                 # cupysparse.networks.inference runs it without torch

Module and parameter names follow the description's layer names, so `model.state_dict()` has
exactly the keys `cupysparse.networks.descriptions.parameter_shapes` lists (plus BatchNorm's
`num_batches_tracked`), and a weights file written here loads into `cupysparse.networks.inference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from cupysparse.functional.epilogue import ConvEpilogue
from cupysparse.networks import descriptions as networks
from cupysparse.networks.prefetch import prefetch_kernels
from cupysparse.geometry.sparse_tensor import SparseTensor as CoreSparseTensor
from cupysparse.networks.weights_file import load_weights, save_weights as save_arrays

from cupysparse.adapters.torch.bridge import core_dtype, to_core
from cupysparse.adapters.torch.convolution import SpatiallySparseConv
from cupysparse.adapters.torch.pointwise import SparseBatchNorm, SparseReLU
from cupysparse.adapters.torch.tensor import SparseTensor
from cupysparse.adapters.torch.network_program import NetworkProgram


class _Skips:
    """The tensors saved by `SaveSkip` during one forward call."""

    def __init__(self):
        self.saved: dict[str, SparseTensor] = {}


@dataclass(frozen=True)
class _NormThenReLU:
    """A batch norm and the ReLU after it (module names): in inference, one pass of the epilogue."""

    norm: str
    relu: str


@dataclass(frozen=True)
class _ConvThenNorm:
    """A convolution, the batch norm after it and the ReLU after that, if any (module names): in
    inference, one launch, the norm and the ReLU in the convolution's epilogue."""

    conv: str
    norm: str
    relu: str | None = None


def _register_layers(owner: nn.Module, layers, fwd_algo, bwd_algo) -> list:
    """Add the modules of `layers` to `owner`; returns the steps that run them in order: module names,
    the skips' descriptions, a `_ConvThenNorm` for each convolution followed by a batch norm (and a ReLU),
    and a `_NormThenReLU` for another batch norm followed by a ReLU."""
    steps, previous = [], None
    for layer in layers:
        if isinstance(layer, (networks.SaveSkip, networks.ConcatSkip)):
            steps.append(layer)
        else:
            owner.add_module(layer.name, build_module(layer, fwd_algo, bwd_algo))
            if isinstance(layer, networks.BatchNorm) and isinstance(previous, networks.Conv):
                steps[-1] = _ConvThenNorm(previous.name, layer.name)
            elif isinstance(layer, networks.ReLU) and isinstance(previous, networks.BatchNorm):
                last = steps[-1]
                steps[-1] = (_ConvThenNorm(last.conv, last.norm, layer.name) if isinstance(last, _ConvThenNorm)
                             else _NormThenReLU(previous.name, layer.name))
            else:
                steps.append(layer.name)
        previous = layer
    return steps


def _norm_then_relu(owner: nn.Module, norm_name: str, relu_name: str, input: SparseTensor) -> SparseTensor:
    """One inference epilogue where the norm allows it (`SparseBatchNorm.runs_inference_epilogue`), in
    training one fused norm and ReLU (`SparseBatchNorm.runs_training_norm`) unless a hook would be skipped,
    the two modules otherwise."""
    norm, relu = getattr(owner, norm_name), getattr(owner, relu_name)
    if norm.runs_inference_epilogue(input.features):
        return norm.inference_epilogue(input, relu=True)
    if norm.runs_training_norm(input.features) and not _hooked(norm, relu):
        return norm.training_norm(input, relu=True)
    return relu(norm(input))


def _hooked(*modules: nn.Module) -> bool:
    """Whether calling these modules runs forward hooks (theirs or global ones), which a fusion would skip."""
    return bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks or any(
        module._forward_hooks or module._forward_pre_hooks for module in modules))


def _fused(owner: nn.Module, conv_name: str, norm_name: str, relu_name: str | None, input: SparseTensor,
           residual: torch.Tensor | None = None) -> SparseTensor | None:
    """`relu?(norm(conv(input)) (+ residual))` in the convolution's launch, where the norm folds into it
    (`SparseBatchNorm.folds_into_convolution`), no forward hook would be skipped and the convolution's
    plan fuses an epilogue; None otherwise. A residual block's ReLU is its own (`relu_name` None)."""
    conv, norm = getattr(owner, conv_name), getattr(owner, norm_name)
    relu = None if relu_name is None else getattr(owner, relu_name)
    if not norm.folds_into_convolution() or _hooked(conv, norm, *(() if relu is None else (relu,))):
        return None
    scale, shift = norm.folded()
    return conv.fused_inference(input, ConvEpilogue(scale, shift, residual, relu is not None or residual is not None))


def _run_step(owner: nn.Module, step, input: SparseTensor) -> SparseTensor:
    """Run one of the steps `_register_layers` returns, other than a skip's save or concatenation."""
    if isinstance(step, _ConvThenNorm):
        fused = _fused(owner, step.conv, step.norm, step.relu, input)
        if fused is not None:
            return fused
        output = getattr(owner, step.conv)(input)
        if step.relu is None:
            return getattr(owner, step.norm)(output)
        return _norm_then_relu(owner, step.norm, step.relu, output)
    if isinstance(step, _NormThenReLU):
        return _norm_then_relu(owner, step.norm, step.relu, input)
    return getattr(owner, step)(input)


class SparseSequential(nn.Module):
    """The layers of a `networks.Sequential`, run in order; skip saves and concatenations included."""

    def __init__(self, description: networks.Sequential, fwd_algo=None, bwd_algo=None):
        super().__init__()
        self._steps = _register_layers(self, description.layers, fwd_algo, bwd_algo)

    def forward(self, input: SparseTensor, skips: _Skips | None = None) -> SparseTensor:
        skips = _Skips() if skips is None else skips
        output = input
        for step in self._steps:
            if isinstance(step, networks.SaveSkip):
                skips.saved[step.name] = output
            elif isinstance(step, networks.ConcatSkip):
                output = _concatenate(output, skips.saved.pop(step.skip), step.skip)
            elif isinstance(step, str) and isinstance(getattr(self, step), SparseSequential):
                output = getattr(self, step)(output, skips)
            else:
                output = _run_step(self, step, output)
        return output


def _concatenate(current: SparseTensor, skip: SparseTensor, skip_name: str) -> SparseTensor:
    if not current.shares_coordinates(skip):
        raise ValueError(f"the tensor saved as {skip_name!r} has other coordinates than the one it is appended to; "
                         "a skip must come from the level a transposed convolution returns to")
    return current.replace_feature(torch.cat([current.features, skip.features], dim=1))


class ResidualBlock(nn.Module):
    """`relu(body(x) + shortcut(x))` of a `networks.Residual`. When the body ends with a batch norm,
    the shortcut runs before it, and in inference the norm, the sum and the ReLU are the epilogue of the
    convolution before the norm (`_fused`) or, where that cannot be, one pass of the norm's
    (`SparseBatchNorm.runs_inference_epilogue`)."""

    def __init__(self, description: networks.Residual, fwd_algo=None, bwd_algo=None):
        super().__init__()
        body = description.body
        final = body[-1] if body and isinstance(body[-1], networks.BatchNorm) else None
        self._steps = _register_layers(self, body[:-1] if final else body, fwd_algo, bwd_algo)
        self._final_norm = None
        if final is not None:
            self.add_module(final.name, build_module(final, fwd_algo, bwd_algo))
            self._final_norm = final.name
        # The body ends with a convolution and its norm: in inference, one launch with the sum and the ReLU.
        self._final_conv = final is not None and len(body) > 1 and isinstance(body[-2], networks.Conv)
        self.shortcut = None
        if description.shortcut is not None:
            self.shortcut = SparseSequential(description.shortcut, fwd_algo, bwd_algo)

    def forward(self, input: SparseTensor) -> SparseTensor:
        steps = self._steps
        output = input
        for step in steps[:-1] if self._final_conv else steps:
            output = _run_step(self, step, output)
        identity = input if self.shortcut is None else self.shortcut(input)
        if self._final_conv:
            fused = _fused(self, steps[-1], self._final_norm, None, output, identity.features)
            if fused is not None:
                return fused
            output = getattr(self, steps[-1])(output)
        if self._final_norm is not None:
            norm = getattr(self, self._final_norm)
            if norm.runs_inference_epilogue(output.features, identity.features):
                return norm.inference_epilogue(output, identity.features, relu=True)
            if norm.runs_training_norm(output.features, identity.features) and not _hooked(norm):
                return norm.training_norm(output, identity.features, relu=True)
            output = norm(output)
        return output.replace_feature(torch.relu(output.features + identity.features))


# What `build_module` builds (a `SparseReLU` holds an `nn.ReLU`): a network of these alone may run its steps as a
# `NetworkProgram`.
_PROGRAM_MODULES = (SparseSequential, ResidualBlock, SpatiallySparseConv, SparseBatchNorm, SparseReLU, nn.ReLU)


def build_module(layer, fwd_algo=None, bwd_algo=None) -> nn.Module:
    """The torch module of one layer description (see `cupysparse.networks.descriptions`)."""
    return networks.build_layer(layer, "torch", {
        networks.Conv: lambda conv: SpatiallySparseConv(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, transposed=conv.transposed,
            bias=conv.bias, fwd_algo=fwd_algo, bwd_algo=bwd_algo, padding=conv.padding),
        networks.BatchNorm: lambda norm: SparseBatchNorm(norm.channels, eps=norm.eps, momentum=norm.momentum),
        networks.ReLU: lambda relu: SparseReLU(),
        networks.Sequential: lambda sequential: SparseSequential(sequential, fwd_algo, bwd_algo),
        networks.Residual: lambda residual: ResidualBlock(residual, fwd_algo, bwd_algo),
    })


class SparseNetwork(SparseSequential):
    """A whole `networks.Network` as one module; `description` keeps what it was built from.

    Moved to a GPU or another dtype (`.to()`, `.cuda()`, `.half()`), and switched to training or to
    evaluation there, it starts loading the kernels the tuning caches say its convolutions will run, in
    the background (`cupysparse.networks.prefetch`: the forward's, and in training the backward's); in evaluation
    it then rehearses its forward on a few voxels. `prefetched` is the latest `KernelPrefetch`, or None;
    starting one stops the one before. A call stops what is left of it; copies and pickles carry none.

    In training, a step is one autograd node (`adapters.torch.network_program`: the same results, a fraction of
    the host time) where `one_autograd_node` is true, the default, and nothing of the modules' would be
    missed (a hook on any of them sends the step through them, layer by layer). Its parameters' gradients
    then all arrive as its backward ends: under DistributedDataParallel, whose all-reduce of a bucket starts
    when the bucket's gradients are in, set it to False to overlap the all-reduce with the backward. In
    evaluation with gradients off, a call runs the same program with each batch norm folded into the
    convolution before it, under the same conditions."""

    one_autograd_node = True  # a class default: a network pickled before it existed has it too

    def __init__(self, description: networks.Network, fwd_algo=None, bwd_algo=None):
        super().__init__(description.root, fwd_algo, bwd_algo)
        self.description = description
        self._map_requests = networks.map_requests(description)
        self._algorithms = {"forward": fwd_algo, "backward": bwd_algo}
        self.prefetched = None

    def __getstate__(self):
        # A thread's handle: nothing to copy or pickle; the program is compiled again where needed.
        return {**self.__dict__, "prefetched": None, "_program": None}

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._prefetch_kernels()
        return module

    def train(self, mode: bool = True):
        module = super().train(mode)
        self._prefetch_kernels()
        return module

    def _prefetch_kernels(self) -> None:
        """Prefetch for the device and dtype of the weights, when they are on a GPU in a dtype the core knows."""
        weight = next((p for p in self.parameters() if p.is_floating_point()), None)
        dtype = None if weight is None or not weight.is_cuda else core_dtype(weight.dtype)
        if self.prefetched is not None:
            self.prefetched.stop()  # superseded: left running, its rehearsal would compete with the calls
        if dtype is not None:
            phases = ("forward", "backward") if self.training else ("forward",)
            # Only evaluation rehearses: training runs other kernels (batch statistics, autograd).
            self.prefetched = prefetch_kernels(self.description, dtype, weight.device.index, phases,
                                               self._algorithms, rehearse=None if self.training else self._rehearse)

    def _rehearse(self, tensor: CoreSparseTensor) -> None:
        with torch.no_grad(), torch.cuda.device(tensor.features.device.id):
            self._forward(SparseTensor.from_core(tensor))

    def forward(self, input: SparseTensor) -> SparseTensor:
        if not isinstance(input, SparseTensor):
            raise TypeError(f"input must be a cupysparse.adapters.torch.SparseTensor, got {type(input).__name__}")
        if input.features.shape[1] != self.description.in_channels:
            raise ValueError(f"{self.description.name} takes {self.description.in_channels} input channels, "
                             f"got {input.features.shape[1]}")
        if self.prefetched is not None:
            self.prefetched.stop()
        return self._forward(input)

    def _forward(self, input: SparseTensor) -> SparseTensor:
        # Every map of the network. In inference, over the input's coordinates before its first layer, the rest
        # when a layer first needs one, while the GPU runs the layers before it; in training, with those of the
        # backward pass, all before the first layer: there the host lags behind the GPU, so two steps would only
        # cost it more (`start_maps`). The build holds the caches that padded convolutions' outputs start until the
        # layers that run in them.
        requests = networks.requests_at(self._map_requests, input.tensor_stride)
        if self.training and torch.is_grad_enabled():
            built = input.build_maps(requests, with_reversed=True)
            program = self._network_program() if self.one_autograd_node else None
            runs = program is not None and program.runs_training(input)
            output = program.training_step(input) if runs else super().forward(input)
        else:
            built = input.start_maps(requests)
            program = self._network_program()
            output = program.inference(input) if program is not None and program.runs_inference(input) else (
                super().forward(input))
        del built
        return output

    def _network_program(self) -> NetworkProgram | None:
        """The program of the network's modules as they are, compiled again after one was replaced (a
        `convert_sync_batchnorm`, say); None where a module is not of a type the description builds."""
        modules = _submodules(self, [])
        program = self.__dict__.get("_program")
        if program is None or program.modules != modules:
            if any(type(module) not in _PROGRAM_MODULES for module in modules):
                return None
            program = self.__dict__["_program"] = NetworkProgram(self, self.description, modules)
        return program

    def extra_repr(self) -> str:
        return f"{self.description.name}: {self.description.in_channels} → {self.description.out_channels} channels"


def _submodules(module: nn.Module, found: list) -> list:
    """Every submodule of `module`, depth first in `modules()`'s order (which lists a module shared by two
    parents once, this twice), at a fraction of its cost: a training step checks its network's modules so."""
    for child in module._modules.values():
        if child is not None:
            found.append(child)
            _submodules(child, found)
    return found


def MinkUNet14(in_channels: int = 3, num_classes: int = 20, width: float = 1.0, **algorithms) -> SparseNetwork:
    return SparseNetwork(networks.minkunet(14, in_channels, num_classes, width), **algorithms)


def MinkUNet18(in_channels: int = 3, num_classes: int = 20, width: float = 1.0, **algorithms) -> SparseNetwork:
    return SparseNetwork(networks.minkunet(18, in_channels, num_classes, width), **algorithms)


def MinkUNet34(in_channels: int = 3, num_classes: int = 20, width: float = 1.0, **algorithms) -> SparseNetwork:
    return SparseNetwork(networks.minkunet(34, in_channels, num_classes, width), **algorithms)


def CenterPointBackbone(in_channels: int = 4, width: float = 1.0, padded: bool = False, **algorithms) -> SparseNetwork:
    return SparseNetwork(networks.centerpoint_backbone(in_channels, width, padded), **algorithms)


def observe_convolutions(model: SparseNetwork, observer) -> list:
    """Report each convolution of `model` to `observer` (a `cupysparse.networks.inference.LayerObserver`,
    given core tensors and arrays) as it runs; returns the hook handles (`.remove()` each)."""
    descriptions = dict(networks.convolutions(model.description))
    handles = []
    for path, module in model.named_modules():
        if path not in descriptions:
            continue
        layer = descriptions[path]

        def before(module, inputs, path=path, layer=layer):
            observer.before(path, layer, inputs[0].core)

        def after(module, inputs, output, path=path, layer=layer):
            weight = module.weight.detach().to(output.features.dtype)
            observer.after(path, layer, inputs[0].core, output.core, to_core(weight))

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    return handles


def _to_numpy(tensor: torch.Tensor):
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: hand over the bits
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def save_weights(model: nn.Module, path) -> None:
    """Write `model.state_dict()` to a safetensors file (see `cupysparse.networks.weights_file`)."""
    save_arrays(path, {name: _to_numpy(value) for name, value in model.state_dict().items()})


def load_weights_into(model: nn.Module, path, strict: bool = True):
    """Load a weights file into `model` (`load_state_dict`, converting to each parameter's dtype)."""
    state = model.state_dict()
    arrays = load_weights(path)
    loaded = {}
    for name, array in arrays.items():
        if array.dtype.name == "bfloat16":
            array = array.view("int16")
            value = torch.from_numpy(array.copy()).view(torch.bfloat16)
        else:
            value = torch.from_numpy(array)
        loaded[name] = value.to(state[name].dtype) if name in state else value
    return model.load_state_dict(loaded, strict=strict)
