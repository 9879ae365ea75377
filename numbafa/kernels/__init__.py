"""The compiled core: the ``@njit`` kernels of both passes, tiled as the Neuron kernel, their
compiled entries and launcher. They assume validated, normalised inputs. May import
:mod:`numbafa.conventions`, :mod:`numbafa.compiler` and :mod:`numbafa.platform`, never the checks,
the pipeline or a front door."""
