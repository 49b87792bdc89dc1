"""kimi: an inference server for Moonshot's Kimi-K2 family (README.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kimi")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"
