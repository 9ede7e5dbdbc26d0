"""Tool-call and reasoning parsers: the structs of the seam (``types``), the built-ins, and the registry that loads them with the plugins'."""
