"""A `SparseNetwork`'s step as one flat list of operations compiled once from its description (`NetworkProgram`):
in training one autograd node, whose forward runs the operations in order and whose backward runs them in reverse;
in inference the same operations with each batch norm folded into the convolution before it.

Layer by layer, a MinkUNet18 step is about a hundred autograd nodes and a hundred and fifty module calls,
each tens of microseconds of Python around the launches of a layer that, on the coarse levels, takes the
GPU a few microseconds: the step was bound by the host. Here the forward calls the core's launches
directly (`execution.forward`, `training_norm.run_forward`) and keeps what each operation's backward
reads; the backward calls the core's backward launches (`execution.backward`, `training_norm.run_backward`)
and adds up the gradients of tensors two operations read (a residual's input, a skip). A batch norm runs
with the ReLU after it and the residual sum before that, as in the modules' fused path. A training step keeps a
batch norm's input, not its output, where the backward can recompute the output from what it keeps anyway
(`NetworkProgram._plan_recomputation`): a pass over the features instead of a tensor held from forward to
backward. In inference a convolution followed by a batch norm is one launch with the norm, the residual sum and
the ReLU in its epilogue (`execution.fused_forward`). A slot's features are freed after their last reader.

The results are those of the modules, which remain the path of everything the program does not take
(`NetworkProgram.runs_training`, `runs_inference`): hooks on any of the network's modules, `torch.compile`,
batch norms without running statistics (or, in training, momentum; in inference, a norm in training mode),
dtypes the kernels do not take, gradients in evaluation, and in a training step on the CPU anything but
float32 or float64 without autocast.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as module_hooks

from cupysparse.functional import execution, training_norm
from cupysparse.functional.epilogue import ConvEpilogue
from cupysparse.networks import descriptions as networks

from cupysparse.adapters.torch.bridge import core_dtype, from_core, to_core
from cupysparse.adapters.torch.convolution import TORCH_ARRAYS, SpatiallySparseConv
from cupysparse.adapters.torch.pointwise import SparseBatchNorm, batch_norm_epilogue
from cupysparse.adapters.torch.tensor import SparseTensor
from cupysparse.algorithms import CONV
from cupysparse.tuning.search_space import algorithm_argument


def _argument(algorithm, phase: str) -> str:
    return "" if algorithm is None else algorithm_argument(algorithm, CONV, phase)


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _accumulate(grads: dict, slot: int, grad: torch.Tensor) -> None:
    kept = grads.get(slot)
    grads[slot] = grad if kept is None else kept + grad


class _Step:
    """One call's state: the feature dtype, whether it runs on the GPU, which slots need gradients, what each
    operation keeps for its backward, the outputs its backward recomputed and reads again, the parameters'
    gradients, and on the GPU the batch norms' fp32 scratch (`NetworkProgram.scratch_floats`) and their reduction
    workspace, by address."""

    def __init__(self, program: NetworkProgram, dtype: torch.dtype, on_gpu: bool, parameters: list):
        self.program, self.dtype, self.on_gpu, self.parameters = program, dtype, on_gpu, parameters
        self.requires: list[bool] = []  # by slot
        self.requires_by_operation: list[bool] = []  # whether any of an operation's parameters requires a gradient
        self.saved: list = []
        self.parameter_grads: dict[int, torch.Tensor] = {}  # by the parameter's id
        self.scratch: torch.Tensor | None = None  # kept for the step: the backward reads it too
        self.norm_scratch = self.reduction = 0
        self.recomputed: dict[int, torch.Tensor] = {}  # by slot: outputs not kept, while the backward reads them
        self.position = 0  # the operation whose backward runs

    def recomputed_features(self, slot: int) -> torch.Tensor:
        """The features of `slot`, an output the step did not keep (`NetworkProgram.recompute`)."""
        return self.program.recompute(self, slot, True)

    def allocate_scratch(self, norm_floats: int, reduction_floats: int, like: torch.Tensor) -> None:
        """The norms' `norm_floats` fp32 words, then a reduction workspace of `reduction_floats`, zeroed (its
        tickets must be), in one allocation on `like`'s device."""
        self.scratch = torch.zeros(norm_floats + reduction_floats, dtype=torch.float32, device=like.device)
        self.norm_scratch = self.scratch.data_ptr()
        self.reduction = self.norm_scratch + 4 * norm_floats


class _Conv:
    """A convolution (and its bias) from slot `source` to slot `target`."""

    def __init__(self, module: SpatiallySparseConv, source: int, target: int):
        self.module, self.source, self.target = module, source, target
        self.sources = (source,)
        self.input_recomputed = False  # the backward recomputes its input (`NetworkProgram._plan_recomputation`)

    def parameters(self) -> tuple:
        weight, bias = self.weight_and_bias()
        return (weight,) if bias is None else (weight, bias)

    def weight_and_bias(self) -> tuple:
        """The module's weight and bias (None: none), from its dictionary, not its attributes: an attribute costs
        about a microsecond, and a step reads every operation's parameters."""
        parameters = self.module._parameters
        return parameters["weight"], parameters.get("bias")

    def operands(self, dtype: torch.dtype, values: list) -> tuple:
        """(input tensor, features and weight in `dtype`, the map's `MapResult`) of a call."""
        place, features = values[self.source]
        conv = self.module
        weight = self.weight_and_bias()[0]
        weight = weight if weight.dtype == dtype else weight.to(dtype)
        result = place.kernel_map(conv.kernel_size, conv.stride, conv.dilation, conv.transposed, conv.generative,
                                  conv.padding)
        return place, _in_dtype(features, dtype), weight.contiguous(), result

    def forward(self, step: _Step, values: list):
        place, features, weight, result = self.operands(step.dtype, values)
        kernel_map = result.kernel_map
        out = execution.forward(TORCH_ARRAYS, features, weight, kernel_map, _argument(self.module.fwd_algo, "forward"))
        self._add_bias(out)
        values[self.target] = (place.with_map_result(result, out), out)
        return None if self.input_recomputed else features, weight, kernel_map

    def infer(self, dtype: torch.dtype, values: list) -> None:
        place, features, weight, result = self.operands(dtype, values)
        out = self.inference_forward(features, weight, result)
        values[self.target] = (place.with_map_result(result, out), out)

    def inference_forward(self, features: torch.Tensor, weight: torch.Tensor, result) -> torch.Tensor:
        """The output features with the bias added; the padded weight is kept from call to call."""
        out = execution.forward(TORCH_ARRAYS, features, weight, result.kernel_map,
                                _argument(self.module.fwd_algo, "forward"), reuse_weight=True)
        self._add_bias(out)
        return out

    def _add_bias(self, out: torch.Tensor) -> None:
        bias = self.weight_and_bias()[1]
        if bias is not None:
            out += bias.to(out.dtype)

    def backward(self, step: _Step, saved, grads: dict) -> None:
        features, weight, kernel_map = saved
        grad = grads.pop(self.target).contiguous()
        parameter, bias = self.weight_and_bias()
        needs_input, needs_weight = step.requires[self.source], parameter.requires_grad
        if needs_input or needs_weight:
            if features is None:
                features = step.recomputed_features(self.source)
            grad_input, grad_weight = execution.backward(TORCH_ARRAYS, grad, features, weight, kernel_map,
                                                         _argument(self.module.bwd_algo, "backward"), needs_input,
                                                         needs_weight)
            if needs_weight:
                step.parameter_grads[id(parameter)] = _in_dtype(grad_weight, parameter.dtype)
            if needs_input:
                _accumulate(grads, self.source, grad_input)
        if bias is not None and bias.requires_grad:
            step.parameter_grads[id(bias)] = grad.sum(0, dtype=torch.promote_types(grad.dtype, torch.float32)).to(
                bias.dtype)


class _Norm:
    """A batch norm from slot `source` to slot `target` (over the batch's statistics in training, the running ones
    in inference), with the sum of slot `residual` (None: none) and a ReLU after it where `relu`."""

    def __init__(self, module: SparseBatchNorm, source: int, target: int, residual: int | None, relu: bool):
        self.module, self.source, self.target = module, source, target
        self.residual, self.relu = residual, relu
        self.sources = (source,) if residual is None else (source, residual)
        self.scratch_offset = 0  # bytes into the step's norm scratch (`NetworkProgram`)
        # A training step does not keep its output but recomputes it (`NetworkProgram._plan_recomputation`), from
        # the residual's features, kept by reference where `keeps` says so, else recomputed too.
        self.recomputed, self.keeps = False, ()

    def recompute_sources(self) -> tuple:
        """The slots besides its input, which it keeps anyway, that recomputing its output reads."""
        return () if self.residual is None else (self.residual,)

    def parameters(self) -> tuple:
        parameters = self.module._parameters
        weight, bias = parameters.get("weight"), parameters.get("bias")
        if weight is not None and bias is not None:
            return weight, bias
        return tuple(parameter for parameter in (weight, bias) if parameter is not None)

    def state(self) -> tuple:
        """The module's weight, bias, running mean, running variance and count of batches (each None where it has
        none), from its dictionaries (see `_Conv.weight_and_bias`)."""
        parameters, buffers = self.module._parameters, self.module._buffers
        return (parameters.get("weight"), parameters.get("bias"), buffers.get("running_mean"),
                buffers.get("running_var"), buffers.get("num_batches_tracked"))

    def forward(self, step: _Step, values: list):
        place, features = values[self.source]
        residual = None if self.residual is None else values[self.residual][1]
        norm = self.module
        if features.shape[0] < 2:  # torch's batch norm refuses it too
            raise ValueError(f"a batch norm in training needs more than 1 value per channel, got "
                             f"{tuple(features.shape)}")
        if features.shape[1] != norm.num_features:  # the kernels read `num_features` parameters a row
            raise ValueError(f"a batch norm of {norm.num_features} channels got features of {features.shape[1]}")
        weight, bias, running_mean, running_var, batches_tracked = self.state()
        if step.on_gpu:
            out, saved, _ = training_norm.run_forward(
                TORCH_ARRAYS, features, residual, weight, bias, running_mean, running_var, norm.momentum, norm.eps,
                self.relu, core_dtype(running_mean.dtype), batches_tracked, step.norm_scratch + self.scratch_offset,
                step.reduction)
        else:
            core = _core_or_none
            out, mean, invstd = training_norm.training_batch_norm(
                to_core(features), to_core(running_mean), to_core(running_var), core(weight), core(bias),
                norm.momentum, norm.eps, residual=core(residual), relu=self.relu)
            batches_tracked.add_(1)
            out, saved = from_core(out), (mean, invstd)
        values[self.target] = (place, out)
        kept_residual = residual if self.keeps and self.keeps[0] else None
        return features, out if self.relu and not self.recomputed else None, saved, kept_residual

    def parameter_dtype(self) -> torch.dtype:
        return self.module._buffers["running_mean"].dtype

    def infer(self, dtype: torch.dtype, values: list) -> None:
        place, features = values[self.source]
        values[self.target] = (place, self.inference_epilogue(features, values))

    def inference_epilogue(self, features: torch.Tensor, values: list) -> torch.Tensor:
        """`relu?(norm(features) (+ residual))` under the running statistics, in one pass."""
        norm = self.module
        residual = None if self.residual is None else values[self.residual][1]
        weight, bias, running_mean, running_var, _ = self.state()
        return batch_norm_epilogue(features, running_mean, running_var, weight, bias, norm.eps, residual, self.relu)

    def backward(self, step: _Step, saved, grads: dict) -> None:
        features, out, statistics, _ = saved
        if self.relu and out is None:
            out = step.recomputed_features(self.target)
        grad = grads.pop(self.target).contiguous()
        with_residual = self.residual is not None
        weight, bias, running_mean, _, _ = self.state()
        wants_parameters = any(parameter is not None and parameter.requires_grad for parameter in (weight, bias))
        if step.on_gpu:
            grad_features, parameter_grads, grad_residual = training_norm.run_backward(
                TORCH_ARRAYS, grad, features, out, statistics, weight, self.relu, with_residual,
                core_dtype(running_mean.dtype), wants_parameters, step.norm_scratch + self.scratch_offset,
                step.reduction)
            if wants_parameters:
                parameter_grads = parameter_grads.unbind()
        else:
            core = _core_or_none
            grad_features, grad_weight, grad_bias, grad_residual = training_norm.training_batch_norm_backward(
                to_core(grad), to_core(features), core(out), *statistics, core(weight), relu=self.relu,
                with_residual=with_residual)
            grad_features = from_core(grad_features)
            grad_residual = None if grad_residual is None else from_core(grad_residual)
            parameter_grads = (from_core(grad_weight), from_core(grad_bias))
        if wants_parameters:  # the weight's gradient, then the bias's
            for parameter, parameter_grad in zip((weight, bias), parameter_grads):
                if parameter is not None and parameter.requires_grad:
                    step.parameter_grads[id(parameter)] = _in_dtype(parameter_grad, parameter.dtype)
        _accumulate(grads, self.source, grad_features)
        if with_residual:
            _accumulate(grads, self.residual, grad_residual)


def _core_or_none(tensor):
    return None if tensor is None else to_core(tensor)


def _renormalised(step: _Step, chain: list, residual) -> torch.Tensor:
    """The output of the first of `chain`'s norms again, with the bits its forward gave: `chain` (norm, its input,
    its statistics) the norms whose outputs are one another's residuals, the last one's over `residual` (None:
    none). On the GPU one pass (`training_norm.run_renormalise`), on the CPU a norm at a time."""
    links = []
    for norm, features, statistics in chain:
        weight, bias, _, _, _ = norm.state()
        links.append(training_norm.NormLink(features, weight, bias, *statistics, norm.relu))
    if step.on_gpu:
        return training_norm.run_renormalise(TORCH_ARRAYS, links, residual, core_dtype(chain[0][0].parameter_dtype()))
    core = _core_or_none
    for link in reversed(links):
        residual = from_core(training_norm.renormalise(to_core(link.features), link.saved_mean, link.saved_invstd,
                                                       core(link.weight), core(link.bias), residual=core(residual),
                                                       relu=link.relu))
    return residual


class _ReLU:
    """`relu(source (+ residual))` with torch's kernels: a ReLU or a residual sum not after a batch norm."""

    def __init__(self, source: int, target: int, residual: int | None = None):
        self.source, self.target, self.residual = source, target, residual
        self.sources = (source,) if residual is None else (source, residual)

    def parameters(self) -> tuple:
        return ()

    def forward(self, step: _Step, values: list):
        place, features = values[self.source]
        if self.residual is not None:
            features = features + values[self.residual][1]
        out = torch.relu(features)
        values[self.target] = (place, out)
        return out

    def infer(self, dtype: torch.dtype, values: list) -> None:
        self.forward(None, values)

    def backward(self, step: _Step, out, grads: dict) -> None:
        grad = grads.pop(self.target) * (out > 0)
        _accumulate(grads, self.source, grad)
        if self.residual is not None:
            _accumulate(grads, self.residual, grad)


class _Concat:
    """The features of slot `skip` appended to those of slot `source` (a U-Net's skip)."""

    def __init__(self, source: int, skip: int, target: int, name: str):
        self.source, self.skip, self.target, self.name = source, skip, target, name
        self.sources = (source, skip)
        # As `_Norm`'s: a training step recomputes the output, from the parts `keeps` (by source) it keeps.
        self.recomputed, self.keeps = False, ()

    def recompute_sources(self) -> tuple:
        return self.sources

    def parameters(self) -> tuple:
        return ()

    def forward(self, step: _Step, values: list):
        (place, features), (skip_place, skip_features) = values[self.source], values[self.skip]
        if not place.shares_coordinates(skip_place):
            raise ValueError(f"the tensor saved as {self.name!r} has other coordinates than the one it is appended "
                             f"to; a skip must come from the level a transposed convolution returns to")
        values[self.target] = (place, torch.cat([features, skip_features], dim=1))
        parts = None
        if self.recomputed:
            parts = tuple(part if kept else None for part, kept in zip((features, skip_features), self.keeps))
        return features.shape[1], parts

    def recompute(self, step: _Step, saved) -> torch.Tensor:
        """The output `forward` gave, again, from its parts: those it kept and those recomputed."""
        parts = [step.program.recompute(step, slot, False) if part is None else part
                 for slot, part in zip(self.sources, saved[1])]
        return torch.cat(parts, dim=1)

    def infer(self, dtype: torch.dtype, values: list) -> None:
        self.forward(None, values)

    def backward(self, step: _Step, saved, grads: dict) -> None:
        channels = saved[0]
        grad = grads.pop(self.target)
        _accumulate(grads, self.source, grad[:, :channels])
        _accumulate(grads, self.skip, grad[:, channels:])


class _ConvThenNorm:
    """Inference's convolution and the batch norm that alone reads its output (with the residual sum and the ReLU
    after it): one launch where the convolution's plan fuses an epilogue, else the convolution, then the norm's
    pass. It runs where the norm did, after a residual block's shortcut."""

    def __init__(self, conv: _Conv, norm: _Norm):
        self.conv, self.norm, self.target = conv, norm, norm.target
        self.sources = conv.sources if norm.residual is None else (*conv.sources, norm.residual)

    def infer(self, dtype: torch.dtype, values: list) -> None:
        conv, norm = self.conv, self.norm
        place, features, weight, result = conv.operands(dtype, values)
        out = None
        if conv.weight_and_bias()[1] is None and features.is_cuda:
            scale, shift = norm.module.folded()
            residual = None if norm.residual is None else values[norm.residual][1]
            out = execution.fused_forward(TORCH_ARRAYS, features, weight, result.kernel_map,
                                          _argument(conv.module.fwd_algo, "forward"),
                                          ConvEpilogue(scale, shift, residual, norm.relu))
        if out is None:
            out = norm.inference_epilogue(conv.inference_forward(features, weight, result), values)
        values[self.target] = (place.with_map_result(result, out), out)


class NetworkProgram:
    """The operations of a network's step over numbered slots of features (slot 0 the input), compiled from its
    description, each bound to the modules that hold its parameters (`modules`: the network's, whose types its
    caller has checked to be those the description builds): `operations` for a training step,
    `inference_operations` for inference, with the slots freed after each of those (`releases`, and for training
    `training_releases`)."""

    def __init__(self, network: torch.nn.Module, description: networks.Network, modules: list):
        self._network = network  # while compiling
        self.operations: list = []
        self.slots = 1
        self._last_reading: dict[int, int] = {}  # a recomputed slot's first reader in the forward, its last backward
        self.output = self._compile(description.root, "", 0, {})
        del self._network
        self._producers = {operation.target: index for index, operation in enumerate(self.operations)}
        self._frees = self._plan_recomputation()
        # The network's modules (not itself, whose hooks run around the program) when it was compiled.
        self.modules = modules
        self.scratch_floats, self.widest_norm = self._lay_out_scratch()
        self.inference_operations = self._fold_norms()
        self.releases = self._releases(self.inference_operations)
        self.training_releases = self._releases(self.operations)
        # What each call checks: the modules' state may have changed since (moved, cast, a norm switched to training).
        self._convolutions = [operation.module for operation in self.operations if isinstance(operation, _Conv)]
        self._norms = [operation.module for operation in self.operations if isinstance(operation, _Norm)]

    def _plan_recomputation(self) -> list[tuple[int, ...]]:
        """Mark the batch norms and concatenations whose output a training step recomputes in its backward instead
        of keeping it, and the convolutions reading it. A MinkUNet18 step kept about 1,300 values a voxel at full
        resolution, over half of them outputs of this kind that the next convolution (for its weight's gradient)
        and a ReLU's mask read: a pass over the features recomputes one. Not recomputed: the network's output,
        and an output another norm keeps as its input. Recomputing reads slots besides what the operation keeps
        (`recompute_sources`): each must be recomputed too or kept anyway by another operation, then this one keeps
        a reference. Returns, by operation, the recomputed slots whose last reader in the backward it is: freed
        after its backward."""
        readers: dict[int, list] = {}
        for operation in self.operations:
            for slot in operation.sources:
                readers.setdefault(slot, []).append(operation)
        recomputed: set[int] = set()

        def kept_anyway(slot: int) -> bool:
            producer = self.operations[self._producers[slot]] if slot in self._producers else None
            if isinstance(producer, _ReLU) or (isinstance(producer, _Norm) and producer.relu):
                return True
            return slot != 0 and any(isinstance(reader, (_Conv, _Norm)) and reader.source == slot
                                     for reader in readers.get(slot, ()))

        for operation in self.operations:
            if not isinstance(operation, (_Norm, _Concat)) or operation.target == self.output:
                continue
            if not all(isinstance(reader, (_Conv, _Concat, _ReLU)) or (
                    isinstance(reader, _Norm) and reader.source != operation.target)
                    for reader in readers.get(operation.target, ())):
                continue  # a norm reading it as its input keeps it
            needed = operation.recompute_sources()
            if all(slot in recomputed or kept_anyway(slot) for slot in needed):
                operation.recomputed, operation.keeps = True, tuple(slot not in recomputed for slot in needed)
                recomputed.add(operation.target)
        frees = [[] for _ in self.operations]
        for slot in recomputed:
            # Read in the backward by the convolutions reading it and, for its mask, a norm with a ReLU.
            readings = [index for index, reader in enumerate(self.operations)
                        if isinstance(reader, _Conv) and reader.source == slot]
            for index in readings:
                self.operations[index].input_recomputed = True
            producer = self._producers[slot]
            if isinstance(self.operations[producer], _Norm) and self.operations[producer].relu:
                readings.append(producer)
            if readings:
                self._last_reading[slot] = min(readings)
                frees[min(readings)].append(slot)
        return [tuple(slots) for slots in frees]

    def recompute(self, step: _Step, slot: int, cache: bool) -> torch.Tensor:
        """The features of `slot`, an output the step did not keep (`_plan_recomputation`), recomputed from what it
        kept; held in `step.recomputed` where `cache` and a later operation of the backward reads them too. Slots
        that recomputing another reads are not held: a skip's features, read again at the start of the network,
        would be held through the whole backward."""
        features = step.recomputed.get(slot)
        if features is not None:
            return features
        index = self._producers[slot]
        operation = self.operations[index]
        if isinstance(operation, _Concat):
            features = operation.recompute(step, step.saved[index])
        else:
            features = self._renormalised_from(step, index)
        if cache and self._last_reading.get(slot, step.position) < step.position:
            step.recomputed[slot] = features
        return features

    def _renormalised_from(self, step: _Step, index: int) -> torch.Tensor:
        """The output of the batch norm `operations[index]` again: through the norms whose outputs, not kept, are
        its residual, that one's, and so on, up to `training_norm.CHAIN` of them in one pass, over the residual
        the last one keeps or is given (recomputed alone, or held)."""
        chain = []
        while True:
            norm = self.operations[index]
            features, _, statistics, residual = step.saved[index]
            chain.append((norm, features, statistics))
            if norm.residual is None or residual is not None:
                break
            residual = step.recomputed.get(norm.residual)
            producer = self._producers[norm.residual]
            if residual is not None:
                break
            if (len(chain) == training_norm.CHAIN or not isinstance(self.operations[producer], _Norm)
                    or self.operations[producer].parameter_dtype() != norm.parameter_dtype()):
                residual = self.recompute(step, norm.residual, False)
                break
            index = producer
        return _renormalised(step, chain, residual)

    def _fold_norms(self) -> list:
        """`operations` with each batch norm that alone reads a convolution's output run with it (`_ConvThenNorm`)."""
        readers: dict[int, int] = {}
        for operation in self.operations:
            for slot in operation.sources:
                readers[slot] = readers.get(slot, 0) + 1
        producers = {operation.target: operation for operation in self.operations}
        folded, operations = set(), []
        for operation in self.operations:
            conv = producers.get(operation.source) if isinstance(operation, _Norm) else None
            if isinstance(conv, _Conv) and readers[operation.source] == 1 and operation.source != self.output:
                folded.add(conv)
                operation = _ConvThenNorm(conv, operation)
            operations.append(operation)
        return [operation for operation in operations if operation not in folded]

    def _releases(self, operations: list) -> list[tuple[int, ...]]:
        """The slots each of `operations` reads last (not the output's): freed after it, so that a step holds only
        the features still to be read (and in training what its operations keep for the backward)."""
        last = {slot: index for index, operation in enumerate(operations) for slot in operation.sources}
        releases = [[] for _ in operations]
        for slot, index in last.items():
            if slot != self.output:
                releases[index].append(slot)
        return [tuple(slots) for slots in releases]

    def _lay_out_scratch(self) -> tuple[int, int]:
        """Place each batch norm's fp32 scratch (`training_norm`'s FORWARD_SCRATCH_ROWS rows of its channels, on 16
        bytes) in a step's, which one allocation holds for all of them with the reduction workspace they share: a
        MinkUNet's fifty would each allocate their own. The backward's sums (BACKWARD_SCRATCH_ROWS rows) take the
        first rows of the norm's, where its forward's sums were. Returns the floats of the norms' scratch and the
        widest norm's channels, which size the workspace."""
        floats = widest = 0
        for operation in self.operations:
            if isinstance(operation, _Norm):
                channels = -(-operation.module.num_features // 4) * 4
                operation.scratch_offset = 4 * floats
                floats += training_norm.FORWARD_SCRATCH_ROWS * channels
                widest = max(widest, channels)
        return floats, widest

    def _slot(self) -> int:
        self.slots += 1
        return self.slots - 1

    def _module(self, path: str):
        return self._network.get_submodule(path)

    def _compile(self, layer, path: str, slot: int, skips: dict) -> int:
        if isinstance(layer, networks.Residual):
            body, final = layer.body, None
            if body and isinstance(body[-1], networks.BatchNorm):
                body, final = body[:-1], body[-1]
            output = self._compile_sequence(body, path, slot, skips)
            identity = slot if layer.shortcut is None else self._compile(layer.shortcut, f"{path}.shortcut", slot,
                                                                         skips)
            target = self._slot()
            if final is None:
                self.operations.append(_ReLU(output, target, identity))
            else:
                module = self._module(f"{path}.{final.name}")
                self.operations.append(_Norm(module, output, target, identity, True))
            return target
        if isinstance(layer, networks.Sequential):
            return self._compile_sequence(layer.layers, path, slot, skips)
        raise TypeError(f"cannot compile {type(layer).__name__} on its own")

    def _compile_sequence(self, layers, path: str, slot: int, skips: dict) -> int:
        index = 0
        while index < len(layers):
            layer = layers[index]
            child = f"{path}.{layer.name}" if path else layer.name
            if isinstance(layer, networks.SaveSkip):
                skips[layer.name] = slot
            elif isinstance(layer, networks.ConcatSkip):
                target = self._slot()
                self.operations.append(_Concat(slot, skips.pop(layer.skip), target, layer.skip))
                slot = target
            elif isinstance(layer, networks.Conv):
                target = self._slot()
                self.operations.append(_Conv(self._module(child), slot, target))
                slot = target
            elif isinstance(layer, networks.BatchNorm):
                relu = index + 1 < len(layers) and isinstance(layers[index + 1], networks.ReLU)
                target = self._slot()
                self.operations.append(_Norm(self._module(child), slot, target, None, relu))
                slot = target
                index += relu
            elif isinstance(layer, networks.ReLU):
                target = self._slot()
                self.operations.append(_ReLU(slot, target))
                slot = target
            else:
                slot = self._compile(layer, child, slot, skips)
            index += 1
        return slot

    def _hooked(self) -> bool:
        """Whether calling the modules would run hooks, which the program would skip."""
        if torch.compiler.is_compiling() or module_hooks._has_any_global_hook():
            return True
        for module in self.modules:  # a loop, not a generator: every call of the network runs it
            if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or (
                    module._backward_pre_hooks):
                return True
        return False

    def _convolutions_take(self, features: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether every convolution runs here: its weight on `device`, in `dtype` or cast to it by autocast."""
        autocast = None
        for conv in self._convolutions:
            weight = conv._parameters["weight"]
            if type(conv) is not SpatiallySparseConv or conv.indice_key is not None or weight.device != device:
                return False
            if weight.dtype != dtype:
                if autocast is None:
                    autocast = self._autocast(features)
                if not autocast:
                    return False
        return True

    def runs_training(self, input: SparseTensor) -> bool:
        """Whether `training_step` may stand in for the modules' step on `input` (see the module docstring)."""
        if self._hooked():
            return False
        features = input.features
        dtype = self._dtype(features)
        if features.is_cuda:
            device = features.device
            if device.index != torch.cuda.current_device() or core_dtype(dtype) not in training_norm.KERNEL_DTYPES:
                return False
        elif dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled("cpu"):
            return False
        else:
            device = features.device
        if not self._convolutions_take(features, dtype, device):
            return False
        return all(type(norm) is SparseBatchNorm and norm.training_norm_takes(dtype, device) for norm in self._norms)

    def runs_inference(self, input: SparseTensor) -> bool:
        """Whether `inference` may stand in for the modules' call on `input`: gradients off and every batch norm
        folding into a convolution as the modules' would (`SparseBatchNorm.folds_into_convolution`)."""
        if torch.is_grad_enabled() or self._hooked():
            return False
        features = input.features
        device = features.device
        if features.is_cuda and device.index != torch.cuda.current_device():
            return False
        if not self._convolutions_take(features, self._dtype(features), device):
            return False
        return all(type(norm) is SparseBatchNorm and norm.folds_into_convolution() for norm in self._norms)

    @staticmethod
    def _autocast(features: torch.Tensor) -> bool:
        return torch.is_autocast_enabled(features.device.type)

    def _dtype(self, features: torch.Tensor) -> torch.dtype:
        if self._autocast(features):
            return torch.get_autocast_dtype(features.device.type)
        return features.dtype

    def inference(self, input: SparseTensor) -> SparseTensor:
        """The network's output on `input` in evaluation; its caller has checked `runs_inference`."""
        dtype = self._dtype(input.features)
        values = [None] * self.slots
        values[0] = (input, _in_dtype(input.features, dtype).contiguous())
        for operation, released in zip(self.inference_operations, self.releases):
            operation.infer(dtype, values)
            for slot in released:
                values[slot] = None
        place, features = values[self.output]
        return place.replace_feature(features)

    def training_step(self, input: SparseTensor) -> SparseTensor:
        """The network's output on `input`, differentiable as one node; its caller has checked `runs_training`."""
        # Read each call: a module's parameters may have been replaced since the program was compiled.
        parameters, requires_by_operation = [], []
        for operation in self.operations:
            operation_parameters = operation.parameters()
            parameters.extend(operation_parameters)
            requires_by_operation.append(any([parameter.requires_grad for parameter in operation_parameters]))
        step = _Step(self, self._dtype(input.features), input.features.is_cuda, parameters)
        step.requires_by_operation = requires_by_operation
        holder = []
        features = _NetworkStep.apply(self, step, input, holder, input.features.contiguous(), *parameters)
        return holder[0].replace_feature(features)

    def forward(self, step: _Step, input: SparseTensor, features: torch.Tensor):
        """Run the operations; returns the output slot's (tensor, features)."""
        values = [None] * self.slots
        values[0] = (input, features)
        requires = [False] * self.slots
        requires[0] = features.requires_grad
        for operation, parameters_require in zip(self.operations, step.requires_by_operation):
            requires[operation.target] = parameters_require or any(requires[source] for source in operation.sources)
        step.requires = requires
        if step.on_gpu:
            step.allocate_scratch(self.scratch_floats, training_norm.reduction_floats(self.widest_norm), features)
        saved = step.saved = []
        for operation, released in zip(self.operations, self.training_releases):
            saved.append(operation.forward(step, values))
            for slot in released:  # what the backward reads, the operations keep
                values[slot] = None
        return values[self.output]

    def backward(self, step: _Step, grad_output: torch.Tensor) -> torch.Tensor | None:
        """Every gradient from the output's; returns the input's (None when it needs none)."""
        grads = {self.output: grad_output}
        saved = step.saved
        if step.on_gpu:  # the weight gradients' shares of every fresh map, in one allocation
            calls = []
            for index, operation in enumerate(self.operations):
                if isinstance(operation, _Conv) and operation.weight_and_bias()[0].requires_grad:
                    features, weight, kernel_map = saved[index]
                    if features is None:  # recomputed later: a norm's input has the shape and dtype it will have
                        producer = self._producers[operation.source]
                        if isinstance(self.operations[producer], _Concat):
                            continue  # nothing kept has its shape: the convolution derives its own on first use
                        features = saved[producer][0]
                    calls.append((features, weight, kernel_map, _argument(operation.module.bwd_algo, "backward")))
            execution.derive_backward_formats(TORCH_ARRAYS, calls)
        for index in range(len(self.operations) - 1, -1, -1):
            operation = self.operations[index]
            if operation.target in grads:
                step.position = index
                operation.backward(step, saved[index], grads)
            saved[index] = None  # freed as the modules' autograd nodes free theirs
            for slot in self._frees[index]:
                step.recomputed.pop(slot, None)
        return grads.get(0)


class _NetworkStep(torch.autograd.Function):
    """`NetworkProgram.training_step` as one autograd node: the inputs are the features and every parameter."""

    @staticmethod
    def forward(ctx, program, step, input, holder, features, *parameters):
        tensor, output = program.forward(step, input, features)
        holder.append(tensor)  # the output's coordinates and maps, which autograd does not hand back
        ctx.program, ctx.step, ctx.input_dtype = program, step, features.dtype
        ctx.save_for_backward(output)  # so that autograd refuses a backward after the output changed in place
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        ctx.saved_tensors
        step = ctx.step
        if step is None:
            raise RuntimeError("a network's training step frees what its backward reads as it runs: it goes backward "
                               "once (retain_graph=True cannot repeat it)")
        grad_input = ctx.program.backward(step, grad_output)
        if grad_input is not None and ctx.needs_input_grad[4]:
            grad_input = grad_input.to(ctx.input_dtype)
        else:
            grad_input = None
        ctx.step = None
        grads = step.parameter_grads
        return (None, None, None, None, grad_input, *(grads.get(id(parameter)) for parameter in step.parameters))
