"""OpenAI's chat (`POST /v1/chat/completions`) and completions (`POST /v1/completions`) APIs, laid out as vLLM's
entrypoints/openai: protocol (the request schemas), serving_chat (chat over the chat pipeline, chat/),
serving_completion (raw prompts), tool_params (chat's tools, tool_choice, response_format and reasoning),
prompts (messages and prompts from the request), shapes (bodies, chunks and logprobs in OpenAI's layout)."""
