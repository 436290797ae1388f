"""The package version (read by pyproject.toml and reported by ``fastpersist info``)."""

__version__ = "0.1.0"
