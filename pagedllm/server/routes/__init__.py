"""The OpenAI app's routes, one ``APIRouter`` per concern, over the app's ``EngineClient``.

Each route gets what it needs through FastAPI dependencies (``common``): the per-app
``ServerState`` and ``RouteOptions`` from ``app.state``, and the API-key check. No route module
holds state of its own or reaches into the engine; ``pagedllm.server.api.build_app`` puts the
state on the app and includes the routers.
"""
