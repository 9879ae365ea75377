"""The ``@njit`` kernels. They assume validated, normalised inputs."""
