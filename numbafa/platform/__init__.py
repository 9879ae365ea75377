"""The platform: the CPU this process runs on, SciPy's BLAS and oneDNN.

``cpu`` reads the CPU's model and flags, ``blas`` pins SciPy's BLAS to one thread around a kernel
call, ``onednn`` chooses the GEMM path (``NUMBAFA_GEMM``, :func:`numbafa.forced_gemm_path`) and loads
oneDNN. Imports nothing else of numbafa: every other layer may import it.
"""
