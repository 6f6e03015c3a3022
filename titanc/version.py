"""The package version (one place: the facade re-exports it, checkpoints record it)."""

__version__ = "0.1.0"
