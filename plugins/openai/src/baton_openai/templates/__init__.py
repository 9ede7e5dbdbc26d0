"""Chat templates: the server's own, client-supplied ones in a sandboxed child process, and rendering and tokenizing off the event loop."""
