"""The chat pipeline every chat-shaped API shares (OpenAI chat, and the Anthropic Messages and OpenAI Responses
adapters that sit on it): one internal request (spec), its prompt (render), tool-call formats (tool_formats),
the grammar that enforces structure (structure), model output as events (output, tool_stream), and the run
itself (pipeline). An API adapter translates its request into a `ChatRequestSpec` and the events back into its
own shapes; none re-implements generation or streaming."""
