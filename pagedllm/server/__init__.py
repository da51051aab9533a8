"""OpenAI-compatible HTTP server: ``pagedllm serve`` (``cli``), ``build_app`` (``api``).

Importing this package is cheap: fastapi and uvicorn load only with ``api`` / the serve command.
"""
