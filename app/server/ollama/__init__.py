"""The Ollama API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, `/`) over the
chat pipeline, on `mlxpaged serve`'s port.

protocol.py   the request schemas (pydantic) and Ollama's `options`
options.py    options, keep_alive, think, format and logprobs -> this server's settings (num_ctx and num_predict:
              how the reply's room is set)
convert.py    a chat or generate request -> the pipeline's ChatRequestSpec (messages, tools, raw prompts, context)
models.py     which model a request names (`name:latest` too), through the server's model registry, and
              keep_alive 0's unload
model_info.py models as /api/tags (from their files), /api/show and /api/ps (loaded ones) describe them
shapes.py     the replies, whole or streamed as NDJSON: text, thinking, tool calls, done_reason, timings, context
serving.py    the routes
errors.py     errors in Ollama's shape, chosen by path for every failure under /api/
"""
