"""The custom ops that the rewritten graph calls: fused.py (inference anchors), training.py (training anchors)."""
from .fused import PATHS, conv2d, gemm, conv_out_format
from .training import batch_norm, conv2d_dgrad

__all__ = ["PATHS", "conv2d", "gemm", "conv_out_format", "batch_norm", "conv2d_dgrad"]
