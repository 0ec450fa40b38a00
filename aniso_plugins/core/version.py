"""The package version (also `aniso_plugins.__version__`), written into state and transform files."""

__version__ = "0.2.0"
