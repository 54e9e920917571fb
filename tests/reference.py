"""The float64 reference MoE, now ``moeblaze_ops.testing``; this module keeps the import
path ``from reference import reference_moe`` of the test files working."""

from moeblaze_ops.testing import reference_activation, reference_moe, router_grad_scale  # noqa: F401
