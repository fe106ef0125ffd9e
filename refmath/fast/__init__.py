"""The fast floor: speed machinery above the reference ops, chosen explicitly by its callers.

Each module here computes what a reference op computes, equal bit for bit where its docstring says
so (its tests compare the two), but faster: :mod:`refmath.fast.fused` runs the models' GELU,
SwiGLU, GeGLU and LayerNorm blocks in place, :mod:`refmath.fast.flat_adamw` runs AdamW over one
flat buffer, and :mod:`refmath.fast.products` holds the decode steps' two ways to multiply a few
rows by the weights (BLAS, or the C++ rows kernel), which a caller passes down by name. The
reference ops never import this package; the models, the trainer and the KV cache name what they
take from it.
"""
