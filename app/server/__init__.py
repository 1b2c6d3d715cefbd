"""`mlxpaged serve`: the HTTP server - OpenAI chat/completions, the Anthropic Messages API and the OpenAI
Responses API (installed as mlxpaged_app.server).

Module names follow vLLM's entrypoints. The process: flags (CLI flags and their checks), launcher (bind, load,
warm up, uvicorn, graceful stop). The app: api_server (routes, create_app), middleware (CORS, API key, status
counts), state (ServerConfig, ServerState and its `served_model(name)`), model_registry / model_catalog /
model_loading / served_model / keep_alive (several models on demand within a memory budget), errors
(OpenAI-shaped), metrics and metrics_render (Prometheus, a `model` label per model). A request:
request_body (read, decode, validate), params (SamplingParams), serving (the flow every API shares), chat/ (the
pipeline every chat-shaped API runs on), one package per API - openai/ (chat and completions), anthropic/
(Messages) and responses/ (Responses) - admission (429 beyond a bounded queue), engine_client (submission,
engine events onto the event loop), formatting (ids and token text every body shares), sse (event framing,
streams that end their engine request).

Kept import-free: the CLI imports `flags` to build its parser without loading Starlette.
"""
