"""The Neuron kernel's conventions the kernels and the checks share: its tile sizes
(``tiling``) and its number formats (``dtypes``: bf16 and fp16 rounding and conversions, in njit
code and on arrays). :mod:`numbafa.layout` (a public module, at the top for its import path)
belongs here too. May import :mod:`numbafa.compiler` and :mod:`numbafa.platform`.
"""
