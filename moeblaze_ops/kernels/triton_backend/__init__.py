"""The Triton backend: one grouped-GEMM core, its ``tl`` and Gluon forms, and the kernels
around them.

- ``grouped_gemm``: the core, as ``@triton.jit`` pieces (the persistent schedules over
  device-side expert offsets, the gathered operand loads, the epilogue store) and their
  host side (buffers, grid, TMA descriptors, which Gluon module a GEMM runs).
- ``experts`` (forward: the gathered GEMM, the activation pass) and ``experts_backward``
  (dH with the router gradient, the weight gradients, dX): the ``tl`` kernels made of the
  core, portable to every GPU Triton supports and the interpreter; the Inductor templates
  (``lowerings/templates.py``) call the same per-tile functions.
- ``gluon``: the Hopper forms of the same GEMMs (wgmma, TMA, mbarrier rings, warp
  specialisation), where ``kernels.config`` says they run.
- ``dispatch`` (the routing's index arrays), ``combine`` (each token's K rows summed in a
  fixed order) and ``activations`` (the activation math, one home for every kernel).

The ops call ``experts`` / ``experts_backward`` / ``dispatch`` through
``kernels.load_triton_backend()``; nothing here is imported before Triton is needed.
"""
