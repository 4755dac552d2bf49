"""`minisgl serve`: an OpenAI-compatible HTTP server over one in-process engine (FastAPI + uvicorn,
the `serve` extra). `create_app(engine)` builds the ASGI app; `run_server(engine, ...)` serves it.
The same app over N engine replicas on Ray Serve (`--replicas N`) is `serve.ray_app.deploy`."""

from minisgl_backend.serve.server import create_app, run_server, start_in_thread

__all__ = ["create_app", "run_server", "start_in_thread"]
