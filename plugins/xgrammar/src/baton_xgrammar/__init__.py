"""baton-plugin-xgrammar: the ``xgrammar`` structured-output backend for baton."""

__version__ = "0.1.0"
