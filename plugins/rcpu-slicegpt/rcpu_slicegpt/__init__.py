"""SliceGPT for rcpu-bench: fuse norms, rotate the residual stream to its principal components, slice it."""

from rcpu_slicegpt.accounting import sliced_parameter_count
from rcpu_slicegpt.layers import LayerDims, SlicedDecoderLayer, SlicePlan
from rcpu_slicegpt.persistence import load_sliced, save_sliced
from rcpu_slicegpt.slicing import fuse_and_rotate, slice_model

__all__ = ["LayerDims", "SlicePlan", "SlicedDecoderLayer", "fuse_and_rotate", "load_sliced", "save_sliced",
           "slice_model", "sliced_parameter_count"]
