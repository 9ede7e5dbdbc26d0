"""The HTTP layer: the FastAPI app, running it under uvicorn, and the ASGI pieces around the routes (limits, CORS, request ids, errors, streaming, admission)."""
