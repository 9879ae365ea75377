"""numbafa: the Neuron NKI flash-attention backward, on the CPU, with Numba.

Public API
----------
attention_bwd
    dQ, dK, dV (and dsinks) in the Neuron kernel's contract and numerics.
golden
    Textbook float64 NumPy references (slow, O(S^2) memory) used by the tests.
"""

from . import golden
from .api import attention_bwd

__version__ = "0.1.0"

__all__ = ["attention_bwd", "golden", "__version__"]
