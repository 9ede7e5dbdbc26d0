"""baton-plugin-shm: the ``shm`` transport, shared-memory ring buffers between frontend and engines."""

__version__ = "0.1.0"
