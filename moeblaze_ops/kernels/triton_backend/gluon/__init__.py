"""The Hopper (sm_90) forms of the grouped GEMMs in Gluon: ``row_gemm`` (up, down and dX
rows), ``dh`` (dH with the activation's backward in the epilogue), ``wgrad`` (both weight
gradients) and what they share (``common``). Imported only where ``kernels.config`` picks
them and this Triton has Gluon."""
