"""The package version (one home: ``leangrad.__version__`` and plan files read it here)."""

__version__ = "0.1.0"
