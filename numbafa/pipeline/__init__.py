"""The one pipeline behind every front door, on the Python side: ``core`` (validate, plan, run
the compiled entry, convert; remembered calls), ``frameworks`` (the torch and JAX host calls),
``shards`` (what a Dask worker runs), ``ranges`` (the exact rescale of a call cut into
shares) and ``ahead`` (passes compiled in a second process, ``numbafa.compile_ahead``).
May import every layer below it (checks, kernels, conventions, compiler, platform), never a
front door.
"""
