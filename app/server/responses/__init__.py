"""`POST /v1/responses`: OpenAI's Responses API over the chat pipeline (chat/), stateless.

protocol (the request schema, what a stateless server refuses), inputs (input items -> chat messages),
options (tools, tool_choice, text.format, reasoning -> the chat spec), shapes (chat events -> output items
and stream events), serving (the endpoint).
"""
