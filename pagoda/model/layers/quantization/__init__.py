"""Quantized weights: the linear-method seam (`base`) and FP8 (`fp8`, `fp8_moe`, `fp8_ops`),
chosen by `config` from the user's setting and the checkpoint's `quantization_config`."""
