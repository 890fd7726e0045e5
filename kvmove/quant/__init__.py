"""Weight quantization for engines that serve FP8: 128x128 block FP8 (e4m3) as DeepSeek-V3/Kimi K2/Qwen3 ship it."""

from kvmove.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    BlockBox,
    BlockQuantized,
    NonFiniteWeightError,
    block_aligned,
    covering_blocks,
    dequantize,
    scale_box,
    scale_shape,
    scale_to_weight_box,
)
from kvmove.quant.quantizer import QUANTIZERS, default_backend, quantize

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZERS",
    "BlockBox",
    "BlockQuantized",
    "NonFiniteWeightError",
    "block_aligned",
    "covering_blocks",
    "default_backend",
    "dequantize",
    "quantize",
    "scale_box",
    "scale_shape",
    "scale_to_weight_box",
]
