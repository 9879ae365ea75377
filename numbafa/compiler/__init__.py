"""The compile machinery: how every function of the package is compiled, linked and cached.

``jit`` (every ``@njit`` flag and the on-disk kernel cache, decided on first use), ``linking``
(calls between separately compiled functions: by address, through cells), ``records`` (named
tuples with a field replaced in njit code), ``runtime`` (``kernel_call``: the BLAS pin and the
compile announcement around every pass), ``memo`` (the bounded stores of checks, plans and
calls already done), ``arrays`` and ``scalars`` (array construction, bit reinterpretation and
``min``/``max`` for njit code, as intrinsics compiled into their callers). May import
:mod:`numbafa.platform`, nothing above it.
"""
