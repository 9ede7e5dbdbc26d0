"""baton-plugin-zmq: the ``zmq`` transport between baton's frontend and engine cores."""

__version__ = "0.1.0"
