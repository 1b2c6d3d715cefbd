"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings` (openai_embeddings.py) and Ollama's `POST /api/embed`
(ollama_embed.py).

protocol.py holds both request schemas; lookup.py is the one place that says which model serves a request;
run.py takes a queue slot and runs the Embedder off the event loop, turning the library's errors into 400s.
"""
