"""Every route this server answers, by dialect: the table `App` is built from."""

from __future__ import annotations

from pooling_pipeline.serve import app, openai_routes, rerank_routes, tei_routes
from pooling_pipeline.serve.app import App, Server, ServeSettings

ROUTE_MODULES = (app, openai_routes, rerank_routes, tei_routes)


def make_app(pipe, settings: ServeSettings) -> App:
    """The ASGI app serving `pipe` (a started Pipeline, closed by its owner)."""
    return App(Server(pipe, settings), [route for module in ROUTE_MODULES for route in module.ROUTES])
