"""The package version, read by ``pyproject.toml`` at build time and re-exported as
``cudnn_bn.__version__``."""

__version__ = "0.2.0"
