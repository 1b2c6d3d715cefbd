"""OpenAI's chat (`POST /v1/chat/completions`) and completions (`POST /v1/completions`) APIs, laid out as vLLM's
entrypoints/openai: protocol (the request schemas), serving_chat (chat over the chat pipeline, chat/, and its
reply shape), serving_completion (raw prompts, and their reply shape), chat_options (chat's tools,
response_format and reasoning), prompts (messages and prompts from the request), shapes (envelopes, logprobs
and what both replies share)."""
