"""Inductor lowerings of the moeblaze GEMM ops to Triton templates (DESIGN.md §5).

Installed as ``moeblaze_ops.lowerings``. No lowering is registered yet: until then the
compiled graphs call the ops' own kernels, which is what Inductor does with any custom
op that has no lowering.
"""
