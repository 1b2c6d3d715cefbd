"""`POST /v1/responses`: a Responses request becomes a ChatRequestSpec, runs through the chat pipeline, and its
events become a response object or the Responses event stream (shapes.ResponseBuilder)."""

from __future__ import annotations

from mlxpaged_app.server.chat.pipeline import ChatRun, serve_chat_request
from mlxpaged_app.server.chat.spec import ChatRequestSpec, SamplingRequest
from mlxpaged_app.server.param_names import RESPONSES
from mlxpaged_app.server.responses.inputs import input_messages
from mlxpaged_app.server.responses.options import check_combination, output_format, reasoning_spec
from mlxpaged_app.server.responses.protocol import ResponsesRequest, check_supported
from mlxpaged_app.server.responses.shapes import ResponseBuilder, response_head
from mlxpaged_app.server.responses.tools import check_choice_not_hosted, responses_tools
from mlxpaged_app.server.server_log import log
from mlxpaged_app.server.state import ServedModel, ServerState
from mlxpaged_app.server.tool_choice import resolve_tool_choice

from starlette.requests import Request
from starlette.responses import Response


def responses_spec(body: ResponsesRequest) -> ChatRequestSpec:
    """The internal request; every 400 names the Responses field at fault."""
    check_supported(body)
    messages = input_messages(body.input, body.instructions)
    tools = responses_tools(body.tools).specs
    check_choice_not_hosted(body.tool_choice)
    choice = resolve_tool_choice(body.tool_choice, tools, "responses")
    output = output_format(body.text)
    check_combination(output, choice)
    sampling = SamplingRequest(temperature=body.temperature, top_p=body.top_p)
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ChatRequestSpec(
        messages,
        tools,
        choice,
        parallel,
        output,
        sampling,
        body.max_output_tokens,
        reasoning=reasoning_spec(body.reasoning),
        stream=bool(body.stream),
        api="responses",
        names=RESPONSES,
    )


def echoed(body: ResponsesRequest, spec: ChatRequestSpec) -> dict:
    """The request settings a response object repeats back."""
    tools = [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        if t.get("type") == "function"
        else t
        for t in body.tools or []
    ]  # namespace and hosted tools as sent
    choice = (
        spec.tool_choice if isinstance(spec.tool_choice, str) else {"type": "function", "name": spec.tool_choice.name}
    )
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": spec.parallel_tool_calls,
        "tool_choice": choice,
        "tools": tools,
        "text": body.text or {"format": {"type": "text"}},
        "reasoning": {"effort": spec.reasoning.effort, "summary": None},
        "metadata": body.metadata or {},
    }


async def serve_responses(request: Request, state: ServerState) -> Response:
    return await serve_chat_request(request, state, ResponsesRequest, responses_spec, _shape)


def _shape(model: ServedModel, body: ResponsesRequest, spec: ChatRequestSpec, run: ChatRun) -> ResponseBuilder:
    tools = responses_tools(body.tools)  # checked in responses_spec already: this reads it again, cheaply
    shape = ResponseBuilder(response_head(model.model_id, echoed(body, spec)), tools.call_fields)
    if tools.dropped:
        note = hosted_tools_note(tools.dropped)
        shape.headers[WARNING_HEADER] = note
        log.warning("POST /v1/responses %s: %s", shape.id, note)
    return shape


WARNING_HEADER = "x-mlxpaged-warning"


def hosted_tools_note(dropped: tuple[str, ...]) -> str:
    return (
        f"hosted tools left out (this server runs function tools only; the model does not see these): "
        f"{', '.join(dropped)}"
    )
