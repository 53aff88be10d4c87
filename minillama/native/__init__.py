"""The compiled wing: C++ kernels for CPU decoding and their Python glue, beside the core.

It reads the core's objects (minillama.model, minillama.kv); the core never imports it. Read in
this order:

* ``backend.py`` -- the one backend switch (reference | kernels | kernels-exact), and the counts
  of what ran and what fell back;
* ``fast.py`` -- ``FastLlama``: the core Llama whose forward takes the compiled path where the
  switch says so, and the loader that returns it;
* ``step.py`` -- a whole decode step in one native call; ``plans.py`` (a cache's layers described
  to the attention kernels), ``token_write.py`` (a decode token's cache write), ``write.py`` (the
  kernels' cache writer), ``weights.py`` (the weights laid out as the step reads them);
* ``minillama.h`` -- the C ABI; ``abi.py``, the same ABI as ctypes sees it, checked at load;
  ``build.py`` compiles the sources for this CPU on first use; ``ops.py``, the kernels as
  functions of tensors;
* the sources: ``linear.cpp`` (projections), ``decode_ops.cpp`` (norms, RoPE, SiLU),
  ``encode.cpp`` (cache writes), ``step.cpp``, ``layer_attention.cpp`` (one layer's decode
  attention) over the per-instruction-set kernels, ``prefill_attention.cpp``.

Every kernel has a PyTorch reference in the core and a test holding the two equal.
"""
