"""The version, kept here and nowhere else: setuptools reads it, ``timewheel`` exports it."""

__version__ = "0.1.0.dev0"
