"""The package version (a leaf module: the manifest writer and the package both read it)."""

__version__ = "0.1.0"
