"""baton-plugin-suffix: the ``suffix`` speculator (suffix decoding) for baton."""

__version__ = "0.1.0"
