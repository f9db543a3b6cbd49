"""The package's version, on the ground floor: rooms that report it (serve's tracing) import it
from here, not from the package root, whose lazy imports reach every room."""

__version__ = "0.1.0"
