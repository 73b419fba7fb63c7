"""Reference networks as framework-free descriptions: MinkUNet14/18/34 and a CenterPoint-style backbone.

A network is a tree of frozen layer descriptions. The PyTorch adapter builds `torch.nn` modules
from it (`cupysparse.adapters.torch.networks`), `cupysparse.networks.inference` runs it on CuPy or NumPy,
and the network benchmark builds the same tree with spconv, so every implementation has one
architecture and one set of parameter names. A parameter's name is the dotted path of layer
names down to it, as in a PyTorch `state_dict`: `encoder1.block0.conv1.weight`.

Layers:
- `Conv`: a sparse convolution (submanifold, strided, or transposed back to finer coordinates; with
  `padding`, spconv's padded convolution), weight `[K, C_in, C_out]`, optional bias;
- `BatchNorm`: per-channel batch normalisation (`weight`, `bias`, `running_mean`, `running_var`);
- `ReLU`;
- `Sequential`: its layers in order;
- `Residual`: `relu(body(x) + shortcut(x))`, the shortcut the identity or a layer sequence;
- `SaveSkip` / `ConcatSkip`: remember the current tensor under a name, and later append its
  features to those of the current tensor, which has the same coordinates (a U-Net's skip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cupysparse.geometry.coords import as_tuple
from cupysparse.geometry.kernel_map import MapRequest

SPATIAL_DIMS = 3
BATCH_NORM_EPS = 1e-5
BATCH_NORM_MOMENTUM = 0.1

MINKUNET_STEM = 32
MINKUNET_ENCODER = (32, 64, 128, 256)
MINKUNET_DECODER = (256, 128, 96, 96)
# Residual blocks per stage (4 encoder stages, then 4 decoder stages), as in MinkowskiEngine's MinkUNets.
MINKUNET_BLOCKS = {14: (1,) * 8, 18: (2,) * 8, 34: (2, 3, 4, 6, 2, 2, 2, 2)}

CENTERPOINT_CHANNELS = (16, 32, 64, 128)
CENTERPOINT_OUT_CHANNELS = 128


@dataclass(frozen=True)
class Conv:
    name: str
    in_channels: int
    out_channels: int
    kernel_size: int | tuple = 3
    stride: int | tuple = 1
    transposed: bool = False
    bias: bool = False
    # None: our output rules; an int or a tuple: spconv's padded convolution (`cupysparse.geometry.padding`),
    # whose output starts a map cache of its own.
    padding: int | tuple | None = None

    def kernel_volume(self) -> int:
        return math.prod(as_tuple(self.kernel_size, SPATIAL_DIMS, "kernel_size"))

    def geometry(self) -> tuple:
        """(kernel size, stride, dilation, padding or None), each a D-tuple: the sizes of its `MapRequest`, which
        its calls pass as they are, so that they find their maps memoised (`KernelMapCache.kernel_map`)."""
        padding = None if self.padding is None else as_tuple(self.padding, SPATIAL_DIMS, "padding", minimum=0)
        return (as_tuple(self.kernel_size, SPATIAL_DIMS, "kernel_size"), as_tuple(self.stride, SPATIAL_DIMS, "stride"),
                (1,) * SPATIAL_DIMS, padding)

    def kind(self) -> str:
        """'submanifold', 'strided' or 'transposed'."""
        if self.transposed:
            return "transposed"
        return "strided" if any(s != 1 for s in as_tuple(self.stride, SPATIAL_DIMS, "stride")) else "submanifold"


@dataclass(frozen=True)
class BatchNorm:
    name: str
    channels: int
    eps: float = BATCH_NORM_EPS
    momentum: float = BATCH_NORM_MOMENTUM


@dataclass(frozen=True)
class ReLU:
    name: str = "relu"


@dataclass(frozen=True)
class Sequential:
    name: str
    layers: tuple


@dataclass(frozen=True)
class Residual:
    name: str
    body: tuple
    shortcut: Sequential | None = None  # None: the identity


@dataclass(frozen=True)
class SaveSkip:
    name: str


@dataclass(frozen=True)
class ConcatSkip:
    """Appends the features saved under `skip` (after the current tensor's own)."""

    name: str
    skip: str


@dataclass(frozen=True)
class Network:
    """A whole network: `root` plus what describes it to a user."""

    name: str
    root: Sequential
    in_channels: int
    out_channels: int


def build_layer(layer, framework: str, builders: dict):
    """`builders[type(layer)](layer)`: the module of one layer description in `framework`, whose builders
    take each kind (Conv, BatchNorm, ReLU, Sequential, Residual); a kind without one is a TypeError."""
    builder = builders.get(type(layer))
    if builder is None:
        raise TypeError(f"no {framework} module for {type(layer).__name__}")
    return builder(layer)


def children(layer) -> tuple:
    """The layers directly inside `layer`, in the order they run."""
    if isinstance(layer, Sequential):
        return layer.layers
    if isinstance(layer, Residual):
        return layer.body + ((layer.shortcut,) if layer.shortcut is not None else ())
    return ()


def walk(layer, prefix: str = ""):
    """(dotted path, layer) for `layer` and everything inside it, depth first in running order.
    The root's own name is not part of the paths."""
    yield prefix, layer
    for child in children(layer):
        yield from walk(child, f"{prefix}.{child.name}" if prefix else child.name)


def parameter_shapes(network: Network) -> dict[str, tuple[int, ...]]:
    """Every parameter and batch-norm statistic: dotted name → shape."""
    shapes = {}
    for path, layer in walk(network.root):
        if isinstance(layer, Conv):
            shapes[f"{path}.weight"] = (layer.kernel_volume(), layer.in_channels, layer.out_channels)
            if layer.bias:
                shapes[f"{path}.bias"] = (layer.out_channels,)
        elif isinstance(layer, BatchNorm):
            for statistic in ("weight", "bias", "running_mean", "running_var"):
                shapes[f"{path}.{statistic}"] = (layer.channels,)
    return shapes


def random_weights(network: Network, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights as the PyTorch modules initialise them: convolution weights and biases
    uniform in ±1/sqrt(K · C_in), batch norms the identity (weight 1, bias 0, mean 0, variance 1)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for path, layer in walk(network.root):
        if isinstance(layer, Conv):
            bound = 1.0 / math.sqrt(layer.kernel_volume() * layer.in_channels)
            shape = (layer.kernel_volume(), layer.in_channels, layer.out_channels)
            weights[f"{path}.weight"] = rng.uniform(-bound, bound, shape).astype(np.float32)
            if layer.bias:
                weights[f"{path}.bias"] = rng.uniform(-bound, bound, layer.out_channels).astype(np.float32)
        elif isinstance(layer, BatchNorm):
            for statistic, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
                weights[f"{path}.{statistic}"] = np.full(layer.channels, value, np.float32)
    return weights


def convolutions(network: Network) -> list[tuple[str, Conv]]:
    """(dotted path, layer) of every convolution, in running order."""
    return [(path, layer) for path, layer in walk(network.root) if isinstance(layer, Conv)]


def coarsest_stride(network: Network) -> np.ndarray:
    """Per axis, the product of the strides of the strided convolutions: the stride of the coarsest level."""
    strides = [as_tuple(conv.stride, SPATIAL_DIMS, "stride") for _, conv in convolutions(network)
               if conv.kind() == "strided"]
    return np.prod(np.array(strides, dtype=np.int64).reshape(-1, SPATIAL_DIMS), axis=0)


def has_padding(network: Network) -> bool:
    """Whether `network` has a padded convolution, whose output voxels depend on the input's spatial shape."""
    return any(conv.padding is not None for _, conv in convolutions(network))


def map_requests(network: Network) -> list[MapRequest]:
    """The kernel maps the convolutions of `network` run over, each once, in running order, with tensor
    strides relative to the input's (what `KernelMapCache.build_maps` builds up front, the strides multiplied
    by the input's). A padded convolution's output starts a map cache of its own, whose maps name it
    (`MapRequest.cache`); its inverse returns to the cache of its input."""
    requests = []
    made: dict[MapRequest, int] = {}  # the cache each padded convolution's output starts
    made_from: dict[int, int] = {}  # each such cache's input's cache

    def run(layer, stride: tuple[int, ...], cache: int) -> tuple[tuple[int, ...], int]:
        if isinstance(layer, Conv):
            kernel_size, conv_stride, dilation, padding = layer.geometry()
            request = MapRequest(stride, kernel_size, conv_stride, dilation, transposed=layer.transposed,
                                 padding=padding, cache=cache)
            if request not in requests:
                requests.append(request)
            if padding is not None and not layer.transposed:
                if request not in made:
                    made[request] = len(made) + 1
                    made_from[made[request]] = cache
                cache = made[request]
            elif padding is not None:
                cache = made_from.get(cache, cache)
            if layer.transposed:
                return tuple(s // t for s, t in zip(stride, request.stride)), cache
            return tuple(s * t for s, t in zip(stride, request.stride)), cache
        if isinstance(layer, Residual):
            out = stride, cache
            for child in layer.body:
                out = run(child, *out)
            if layer.shortcut is not None:
                run(layer.shortcut, stride, cache)  # from the block's input, beside the body
            return out
        for child in children(layer):
            stride, cache = run(child, stride, cache)
        return stride, cache

    run(network.root, (1,) * SPATIAL_DIMS, 0)
    return requests


def requests_at(requests: list[MapRequest], tensor_stride: tuple[int, ...]) -> list[MapRequest]:
    """`requests` (`map_requests`', relative to the input's tensor stride) for an input at `tensor_stride`."""
    if all(t == 1 for t in tensor_stride):
        return requests
    return [request._replace(tensor_stride=tuple(t * s for t, s in zip(tensor_stride, request.tensor_stride)))
            for request in requests]


def _conv_norm_relu(prefix: str, in_channels: int, out_channels: int, **conv) -> tuple:
    """A convolution, batch norm and ReLU named `{prefix}conv`, `{prefix}norm`, `{prefix}relu`."""
    return (Conv(f"{prefix}conv", in_channels, out_channels, **conv), BatchNorm(f"{prefix}norm", out_channels),
            ReLU(f"{prefix}relu"))


def basic_block(name: str, in_channels: int, out_channels: int, spatial_kernel: int = 3) -> Residual:
    """Two 3^3 submanifold convolutions with batch norm; a 1^3 projection when the width changes."""
    body = (
        Conv("conv1", in_channels, out_channels, spatial_kernel),
        BatchNorm("norm1", out_channels),
        ReLU("relu1"),
        Conv("conv2", out_channels, out_channels, spatial_kernel),
        BatchNorm("norm2", out_channels),
    )
    shortcut = None
    if in_channels != out_channels:
        shortcut = Sequential("shortcut", (Conv("conv", in_channels, out_channels, 1), BatchNorm("norm", out_channels)))
    return Residual(name, body, shortcut)


def _blocks(count: int, in_channels: int, out_channels: int) -> tuple:
    return tuple(basic_block(f"block{i}", in_channels if i == 0 else out_channels, out_channels) for i in range(count))


def _positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_width(width) -> None:
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not (width > 0 and math.isfinite(width)):
        raise ValueError(f"width must be a positive number, got {width!r}")


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


def minkunet(depth: int = 18, in_channels: int = 3, num_classes: int = 20, width: float = 1.0) -> Network:
    """MinkUNet14 / 18 / 34: a stem of two 3^3 convolutions (32 channels), four encoder stages (a
    2^3 stride-2 convolution, then residual blocks: 32, 64, 128, 256 channels), four decoder stages
    (a 2^3 transposed convolution back to the finer coordinates, the encoder's features of that
    level appended, then residual blocks: 256, 128, 96, 96) and a 1^3 classifier with bias.
    `width` scales every channel count."""
    if depth not in MINKUNET_BLOCKS:
        raise ValueError(f"depth must be one of {sorted(MINKUNET_BLOCKS)}, got {depth!r}")
    _positive_int(in_channels, "in_channels")
    _positive_int(num_classes, "num_classes")
    _check_width(width)
    blocks = MINKUNET_BLOCKS[depth]
    stem_channels = _scaled(MINKUNET_STEM, width)
    encoder = [_scaled(c, width) for c in MINKUNET_ENCODER]
    decoder = [_scaled(c, width) for c in MINKUNET_DECODER]

    stem = Sequential("stem", (
        *_conv_norm_relu("first_", in_channels, stem_channels),
        *_conv_norm_relu("second_", stem_channels, stem_channels),
    ))
    stages = [stem]
    skip_channels = []
    channels = stem_channels
    for level, out_channels in enumerate(encoder):
        skip_channels.append(channels)
        stages.append(Sequential(f"encoder{level + 1}", (
            SaveSkip(f"skip{level}"),
            *_conv_norm_relu("down_", channels, channels, kernel_size=2, stride=2),
            *_blocks(blocks[level], channels, out_channels),
        )))
        channels = out_channels
    for level, out_channels in enumerate(decoder):
        skip = len(encoder) - 1 - level
        stages.append(Sequential(f"decoder{level + 1}", (
            *_conv_norm_relu("up_", channels, out_channels, kernel_size=2, stride=2, transposed=True),
            ConcatSkip("concat", f"skip{skip}"),
            *_blocks(blocks[len(encoder) + level], out_channels + skip_channels[skip], out_channels),
        )))
        channels = out_channels
    stages.append(Conv("classifier", channels, num_classes, 1, bias=True))
    return Network(f"MinkUNet{depth}", Sequential("", tuple(stages)), in_channels, num_classes)


def centerpoint_backbone(in_channels: int = 4, width: float = 1.0, padded: bool = False) -> Network:
    """A CenterPoint / SECOND-style sparse ResNet encoder: a 3^3 stem (16 channels) and two
    residual blocks, then three stages of a 3^3 stride-2 convolution and two residual blocks (32,
    64, 128 channels: 8x downsampling), and a (1, 1, 3) convolution of stride (1, 1, 2) that halves
    the height axis (the last coordinate) once more, as the detectors do before the BEV head.

    `padded`: the strided convolutions as spconv's detectors run them, padding 1 (the last one 0), each
    voxel a kernel tap reaches an output (`cupysparse.geometry.padding`); otherwise our output rules."""
    _positive_int(in_channels, "in_channels")
    _check_width(width)
    if not isinstance(padded, bool):
        raise TypeError(f"padded must be a bool, got {padded!r}")
    down_padding, height_padding = (1, 0) if padded else (None, None)
    channels = [_scaled(c, width) for c in CENTERPOINT_CHANNELS]
    out_channels = _scaled(CENTERPOINT_OUT_CHANNELS, width)
    stem = (*_conv_norm_relu("", in_channels, channels[0]), *_blocks(2, channels[0], channels[0]))
    stages = [Sequential("stem", stem)]
    for level in range(1, len(channels)):
        stages.append(Sequential(f"stage{level}", (
            *_conv_norm_relu("down_", channels[level - 1], channels[level], kernel_size=3, stride=2,
                             padding=down_padding),
            *_blocks(2, channels[level], channels[level]),
        )))
    stages.append(Sequential("height", _conv_norm_relu("", channels[-1], out_channels, kernel_size=(1, 1, 3),
                                                       stride=(1, 1, 2), padding=height_padding)))
    return Network("CenterPointBackbone", Sequential("", tuple(stages)), in_channels, out_channels)
