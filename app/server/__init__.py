"""`mlxpaged serve`: the OpenAI-compatible HTTP server (installed as mlxpaged_app.server)."""
