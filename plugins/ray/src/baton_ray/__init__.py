"""baton-plugin-ray: the ``ray`` executor (tensor x pipeline parallel ranks as Ray actors)."""

__version__ = "0.1.0"
