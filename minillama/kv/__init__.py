"""The KV cache wing: everything about storing keys and values, and nothing about models.

Read bottom-up: ``packing`` (bits into bytes) and ``quantize`` (pure quantizers) ->
``codecs`` (what one tensor stores; ``freq_blocks``, keys with bits per RoPE frequency block;
``spec``, the ``--kv`` grammar) -> ``ring`` (a fixed FIFO in a
preallocated buffer) -> ``store`` (sinks | quantized body | residual of one tensor) ->
``cache`` (every layer's keys and values, positions and byte counters; ``write`` encodes what
it appends) -> ``group`` (several caches as one batch), ``file`` (a cache saved and loaded),
``budget`` (byte budgets, measured and closed form) and ``fused_attention`` (a layer's packed
parts described to the kernels of ``minillama.native``, the wing below). Imports nothing from
the wings above it.
"""
