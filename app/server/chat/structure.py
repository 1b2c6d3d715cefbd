"""The grammar a chat request's output must follow, from its response format, tools and tool choice, compiled
against the model's tokenizer (mlxpaged.constraints, llguidance underneath); a grammar that cannot be built
or compiled is the client's 400, naming llguidance's reason.

  response_format json_schema / json_object  -> the whole reply is that JSON
  tool_choice required / named                -> the whole reply is one tool-call block (the format's markers)
  tool_choice auto                            -> free text until the call marker, then a valid call block
  tool_choice none, or no tools               -> unconstrained
The prompt never depends on any of this (only the grammar does), so switching tool_choice keeps the prefix cache.
"""

from __future__ import annotations

import re

from mlxpaged_app.server.chat.spec import ChatRequestSpec, JsonObjectOutput, JsonSchemaOutput
from mlxpaged_app.server.chat.tool_formats import ToolFormat
from mlxpaged_app.server.errors import invalid_param


def grammar_for(spec: ChatRequestSpec, fmt: ToolFormat, thinking: bool) -> tuple[str, str] | None:
    """(grammar text, the API parameter blamed if it does not compile), or None: nothing to enforce.

    `thinking`: the model may open a think block, which a tool grammar would forbid; auto then stays
    unconstrained (required / named are still enforced: the client asked for a call, not for thoughts)."""
    if spec.output is None and not _tools_enforced(spec, fmt, thinking):
        return None
    from mlxpaged.constraints import GrammarError  # llguidance loads only for requests that need it

    param = spec.names.response_format if spec.output is not None else spec.names.tools
    try:
        return _grammar(spec, fmt), param
    except GrammarError as exc:
        raise invalid_param(param, f"the {param} schema cannot be enforced: {exc}", "invalid_schema") from None


def _tools_enforced(spec: ChatRequestSpec, fmt: ToolFormat, thinking: bool) -> bool:
    if not spec.parses_tools or (spec.tool_choice == "auto" and (thinking or not fmt.enforceable)):
        return False
    if not fmt.enforceable:
        raise invalid_param(
            spec.names.tool_choice,
            f"tool_choice {_shown(spec.tool_choice)} needs constrained "
            f"decoding, which this model's tool-call format ({fmt.name}) "
            "does not support; use tool_choice 'auto'",
            "unsupported_value",
        )
    return True


def _grammar(spec: ChatRequestSpec, fmt: ToolFormat) -> str:
    from mlxpaged.constraints import json_object_grammar, json_schema_grammar, tagged_json_grammar

    if isinstance(spec.output, JsonSchemaOutput):
        return json_schema_grammar(spec.output.schema, strict=spec.output.strict)
    if isinstance(spec.output, JsonObjectOutput):
        return json_object_grammar()
    begin, end = fmt.grammar_markers()
    schema = fmt.calls_schema(spec.tools, spec.tool_choice, spec.parallel_tool_calls)
    lazy = spec.tool_choice == "auto"
    return tagged_json_grammar(begin, end, schema, lazy=lazy, trigger=fmt.start if lazy else None)


def compile_constraint(engine, grammar: tuple[str, str] | None):
    """The engine's Constraint for the grammar (runs in a worker thread: a first compile takes ~0.3 s)."""
    if grammar is None:
        return None
    from mlxpaged.constraints import GrammarError

    text, param = grammar
    try:
        return engine.grammar_compiler.compile(text)
    except GrammarError as exc:
        raise invalid_param(param, f"the {param} schema cannot be enforced: {exc}", "invalid_schema") from None


def grammar_notes(spec: ChatRequestSpec, warnings: tuple[str, ...]) -> list[str]:
    """llguidance's warnings (a schema keyword it does not enforce) as log lines naming the schema they are
    about: the tools whose parameters use the keyword, or the response format."""
    notes = []
    for warning in warnings:
        keys = set(re.findall(r'"([A-Za-z$_][\w$]*)"', warning))
        if spec.output is not None:
            about = spec.names.response_format
        else:
            named = [t.name for t in spec.tools if keys & _schema_keys(t.parameters)] or [t.name for t in spec.tools]
            about = f"tool{'s' if len(named) > 1 else ''} {', '.join(named)}"
        notes.append(f"grammar for {about} not fully enforced (the output may break these rules): {warning}")
    return notes


def _schema_keys(schema: object) -> set[str]:
    """Every object key anywhere in a JSON schema."""
    if isinstance(schema, dict):
        return set(schema).union(*(_schema_keys(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_schema_keys(v) for v in schema))
    return set()


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {{'name': {choice.name!r}}}}}"
