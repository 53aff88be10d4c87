"""Weights as people ship them: llama.cpp's blocks (q8_0, q4_0, q4_1, q4_K, q6_K) kept as stored.

``blocks`` (the layouts, pure quantize/dequantize) -> ``layers`` (``BlockLinear``,
``BlockEmbedding``, the ``quantize_model`` transform) -> ``gguf`` (a llama GGUF loaded with its
blocks in place, its header read by model/gguf_file.py). A wing over the core model; the
compiled wing above it multiplies the blocks (native/linear.cpp)."""
