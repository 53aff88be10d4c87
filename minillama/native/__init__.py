"""The native wing: C++ kernels for CPU decoding, and the one switch that decides whether they run.

The bottom of the package: it imports nothing from the wings above (app -> eval -> model ->
kv -> native). Read in this order:

* ``backend.py`` -- the one backend switch (reference | kernels | kernels-exact);
* ``minillama.h`` -- the C ABI: every function and struct Python passes, declared once;
* ``abi.py`` -- the same ABI as ctypes sees it, checked against the library when it loads;
* ``build.py`` -- compiles the sources for this CPU on first use (cached by CPU features);
* ``ops.py`` -- the kernels as functions of tensors;
* the sources: ``linear.cpp`` (projections), ``decode_ops.cpp`` (norms, RoPE, SiLU),
  ``encode.cpp`` (cache writes), ``layer_attention.cpp`` (one layer's decode attention)
  over ``decode_attention.cpp`` (exact float kernels per codec family), ``int_attention.cpp``
  (integer-domain kernels) and ``row_attention.cpp`` (a decoded row at a time), with
  ``rows.h``, ``dtypes.h`` and ``hadamard.h`` (the FWHT's butterflies) shared between them.

Every kernel has a PyTorch reference (model/, kv/) and a test holding the two equal.
"""
