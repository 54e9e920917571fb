"""The portable backend: every op in vectorised PyTorch (``dispatch``, ``experts``), for
CPU tensors, float64, and ``settings.backend == "torch"``; also the reference the Triton
kernels are tested against."""
