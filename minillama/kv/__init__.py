"""The KV cache wing: everything about storing keys and values, and nothing about models.

Read bottom-up: ``packing`` (bits into bytes) and ``quantize`` (pure quantizers) ->
``codecs`` (what one tensor stores; ``freq_blocks``, keys with bits per RoPE frequency block;
``spec``, the ``--kv`` grammar; ``auto`` and ``allocate``, per-layer codecs chosen) -> ``ring``
(a fixed FIFO in a preallocated buffer) -> ``store`` (sinks | quantized body | tier | residual of
one tensor) -> ``write`` (a write's arithmetic) -> ``layered`` (one tensor of every layer that
shares a codec, written at once) -> ``cache`` (every layer's keys and values, positions and byte
counters) -> ``group`` (several caches as one batch), ``file`` (a cache saved and loaded),
``budget`` (byte budgets, measured and closed form). ``interface`` is what the model may touch.
Plain PyTorch; imports nothing from the other wings.
"""
