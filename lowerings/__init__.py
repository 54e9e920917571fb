"""Inductor lowerings of the moeblaze GEMM ops to Triton templates.

Installed as ``moeblaze_ops.lowerings``. No lowering is registered yet: until then the
compiled graphs call the ops' own kernels, which is what Inductor does with any custom
op that has no lowering. The templates are to call the grouped-GEMM core's helpers
(``moeblaze_ops.kernels.grouped_gemm``: schedules, operand loads, ``store_tile``) rather
than fork the eager kernels.
"""
