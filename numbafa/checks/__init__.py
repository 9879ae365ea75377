"""The checks of a call, in the caller's words: ``options`` (``AttentionOptions``, every option of a
call as one value, and ``Caller``, the front door's names) and ``validation`` (shapes, dtypes,
options, from metadata; the values are checked by the compiled entries). May import
:mod:`numbafa.kernels` and the layers below it, never the pipeline or a front door.
"""
