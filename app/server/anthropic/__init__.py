"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat pipeline.

protocol.py  the request schemas (pydantic)
convert.py   a Messages request -> the pipeline's ChatRequestSpec (system, content blocks, tools, tool_choice)
serving.py   the two routes
shapes.py    the `message` reply, whole (content blocks, stop_reason, usage) or streamed (message_start, ping,
             content blocks, message_delta)
streaming.py chat events -> content-block events
errors.py    errors in Anthropic's shape, chosen by path for every failure on /v1/messages*
"""
