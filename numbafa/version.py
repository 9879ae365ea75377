"""The package version (imports nothing, so that any module and ``setup.cfg`` can read it)."""

__version__ = "0.1.0"
