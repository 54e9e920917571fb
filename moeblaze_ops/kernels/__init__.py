"""Kernels behind the ops.

``torch_dispatch`` and ``torch_experts`` are the portable implementations in vectorised
PyTorch: the CPU kernels, and for now the CUDA ones too.
"""
