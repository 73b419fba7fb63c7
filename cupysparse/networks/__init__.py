"""The reference networks (MinkUNet14/18/34, a CenterPoint-style backbone) as framework-free
descriptions, their inference on NumPy or CuPy, weight files and layouts, and loading their kernels
ahead of their first call."""

from cupysparse.networks.descriptions import Network, centerpoint_backbone, minkunet, random_weights
from cupysparse.networks.inference import InferenceNetwork, LayerObserver
from cupysparse.networks.prefetch import prefetch_kernels
from cupysparse.networks.weight_layouts import (
    from_spconv_weight,
    from_torch_conv_transpose_weight,
    from_torch_conv_weight,
    to_spconv_weight,
    to_torch_conv_transpose_weight,
    to_torch_conv_weight,
)
from cupysparse.networks.weights_file import load_metadata, load_weights, save_weights

__all__ = [
    "InferenceNetwork",
    "LayerObserver",
    "Network",
    "centerpoint_backbone",
    "from_spconv_weight",
    "from_torch_conv_transpose_weight",
    "from_torch_conv_weight",
    "load_metadata",
    "load_weights",
    "minkunet",
    "prefetch_kernels",
    "random_weights",
    "save_weights",
    "to_spconv_weight",
    "to_torch_conv_transpose_weight",
    "to_torch_conv_weight",
]
