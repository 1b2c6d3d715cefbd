"""Constrained decoding (mlxpaged.constraints): grammar builders against the real SmolLM2 tokenizer, the
bitmask against slow twins, and the batched sampler with constrained rows on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import queue
from pathlib import Path

from mlxpaged.config import CacheConfig, split_settings
from mlxpaged.constraints import (
    ConstraintError,
    GrammarCompiler,
    GrammarError,
    allowed_tokens,
    apply_bitmask,
    json_object_grammar,
    json_schema_grammar,
    tagged_json_grammar,
)
from mlxpaged.engine.engine import Engine, RequestFailedError, collect, drain
from mlxpaged.engine.request import Request
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.runner.sampling import LazySample, make_state, sample_batch
from mlxpaged.sampling_params import SamplingParams
from tests.tiny_models import random_tokens, tiny_llama

import jsonschema
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np
import pytest

VOCAB = 49152  # SmolLM2's logits width
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
}
SMALL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "n", "ok"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
}


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def accepts(constraint, token_ids: list[int]) -> bool:
    """True when the grammar takes these tokens and may end after them."""
    row = constraint.new_row()
    try:
        row.catch_up(token_ids)
    except ConstraintError:
        return False
    return row.accepting


def in_schema_order(value: dict, schema: dict) -> bool:
    order = list(schema["properties"])
    keys = [order.index(k) for k in value if k in order]
    return keys == sorted(keys)


PEOPLE = [
    {"name": "Ada", "age": 36},
    {"name": "Bo", "age": 0, "tags": ["x", "y z"]},
    {"age": 36, "name": "Ada"},
    {"name": "Ada"},
    {"name": "Ada", "age": -1},
    {"name": "Ada", "age": 3, "extra": 1},
    {"name": "Ada", "age": 3, "tags": ["a", "b", "c"]},
    {"name": "far too long", "age": 3},
    [1, 2],
]


@pytest.mark.parametrize("value", PEOPLE, ids=json.dumps)
def test_json_schema_grammar_takes_exactly_the_valid_values_in_json_dumps_layout(tokenizer, compiler, value):
    constraint = compiler.compile(json_schema_grammar(PERSON))
    valid = jsonschema.Draft202012Validator(PERSON).is_valid(value) and in_schema_order(value, PERSON)
    assert accepts(constraint, ids(tokenizer, json.dumps(value))) == valid
    for layout in ({"separators": (",", ":")}, {"indent": 2}):  # any other layout is refused
        assert not accepts(constraint, ids(tokenizer, json.dumps(value, **layout)))


def test_json_object_grammar_takes_objects_only(tokenizer, compiler):
    constraint = compiler.compile(json_object_grammar())
    for value in ({}, {"a": [1, {"b": None}], "c": 'd\n"e"'}, {"x": 1.5e-3, "y": True}):
        assert accepts(constraint, ids(tokenizer, json.dumps(value)))
    for text in ("[1, 2]", '"text"', "42", '{"a":1}', '{"a": 1} trailing', '{"a": 1'):
        assert not accepts(constraint, ids(tokenizer, text))


def call(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments})


CALL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "arguments"],
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "required": ["city"],
            "additionalProperties": False,
            "properties": {"city": {"type": "string"}},
        },
    },
}


def test_required_tool_call_grammar_is_the_whole_output(tokenizer, compiler):
    constraint = compiler.compile(tagged_json_grammar("<tool_call>\n", "\n</tool_call>", CALL, lazy=False))
    good = call("get_weather", {"city": "Paris"})
    assert accepts(constraint, ids(tokenizer, f"<tool_call>\n{good}\n</tool_call>"))
    for bad in (
        f"Sure. <tool_call>\n{good}\n</tool_call>",
        f"<tool_call>\n{good}\n</tool_call> ok",
        f"<tool_call>\n{call('get_time', {'city': 'Paris'})}\n</tool_call>",
        f"<tool_call>\n{call('get_weather', {'city': 3})}\n</tool_call>",
        "No call.",
    ):
        assert not accepts(constraint, ids(tokenizer, bad)), bad


def test_lazy_tool_call_grammar_allows_text_then_enforces_the_call(tokenizer, compiler):
    grammar = tagged_json_grammar("<tool_call>\n", "\n</tool_call>", CALL, lazy=True, trigger="<tool_call>")
    constraint = compiler.compile(grammar)
    good, bad = call("get_weather", {"city": "Paris"}), call("get_weather", {"town": "Paris"})
    for text in ("Just text, no call.", f"Checking. <tool_call>\n{good}\n</tool_call> Done.", ""):
        assert accepts(constraint, ids(tokenizer, text)), text
    for text in (f"Checking. <tool_call>\n{bad}\n</tool_call>", f"<tool_call>\n{good}", f"<tool_call> {good}"):
        assert not accepts(constraint, ids(tokenizer, text)), text


def test_markers_that_are_special_tokens_are_matched_as_those_tokens(tokenizer, compiler):
    # <|im_start|> (1) and <file_sep> (5) are special tokens of SmolLM2's tokenizer.
    begin, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<file_sep>"))
    good, bad = (ids(tokenizer, call("get_weather", args)) for args in ({"city": "Oslo"}, {"city": 1}))
    spelled = compiler.tokenizer.greedy_tokenize  # the markers as plain text, not as special tokens
    required = compiler.compile(tagged_json_grammar("<|im_start|>", "<file_sep>", CALL, lazy=False))
    assert accepts(required, [begin, *good, end])
    assert not accepts(required, spelled("<|im_start|>") + good + spelled("<file_sep>"))
    lazy = compiler.compile(tagged_json_grammar("<|im_start|>", "<file_sep>", CALL, lazy=True))
    assert accepts(lazy, [*ids(tokenizer, "Text, "), begin, *good, end, *ids(tokenizer, " more text")])
    assert not accepts(lazy, [*ids(tokenizer, "Text, "), begin, *bad, end])
    assert compiler.marker_pieces("<|im_start|>\nx") == [begin, "\nx"]


@pytest.mark.parametrize(
    "grammar, reason",
    [
        (
            lambda: json_schema_grammar({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
            'Unimplemented keys: ["if", "then"]',
        ),
        (lambda: json_schema_grammar({"$ref": "#/$defs/missing"}), "Pointer '/$defs/missing' does not exist"),
        (lambda: json_schema_grammar({"type": "string", "pattern": "(?=a)b"}), "look-around"),
        (lambda: json_schema_grammar({"type": "strin"}, strict=False), "Invalid type: strin"),
        (lambda: tagged_json_grammar("<a>", "</a>", {"type": "strin"}, lazy=False), "Invalid type: strin"),
        (lambda: "start: foo", 'unknown name: "foo"'),
    ],
)
def test_uncompilable_grammars_raise_grammar_error_with_llguidance_reason(compiler, grammar, reason):
    with pytest.raises(GrammarError) as caught:
        compiler.compile(grammar())
    assert reason in str(caught.value)
    assert str(caught.value) == caught.value.render("cli")  # llguidance's text is never rewritten


def test_bad_builder_arguments_are_grammar_errors(compiler):
    with pytest.raises(GrammarError, match="must be an object"):
        json_schema_grammar("{}")
    with pytest.raises(GrammarError, match="not valid JSON"):
        json_schema_grammar({"enum": [object()]})
    with pytest.raises(GrammarError, match="trigger"):
        tagged_json_grammar("<a>", "</a>", CALL, lazy=True, trigger="<b>")


def test_non_strict_schemas_compile_with_warnings_and_compiles_are_cached(compiler):
    schema = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    constraint = compiler.compile(json_schema_grammar(schema, strict=False))
    assert any("if" in w for w in constraint.warnings)
    assert compiler.compile(json_schema_grammar(schema, strict=False)) is constraint


def test_every_token_the_mask_allows_is_one_the_matcher_takes(tokenizer, compiler):
    """The mask against its slow twin, a copy of the matcher consuming each token. (The mask may be smaller:
    llguidance leaves out tokens that only a non-canonical tokenization would use, e.g. `{` before `"`.)"""
    row = compiler.compile(json_schema_grammar(PERSON)).new_row()
    text = ids(tokenizer, json.dumps({"name": "Ada", "age": 36}))
    bitmask = llg_numpy.allocate_token_bitmask(1, VOCAB)
    for stop in range(len(text) + 1):
        row.catch_up(text[:stop])
        row.fill(bitmask, 0)
        allowed = allowed_tokens(bitmask[0], VOCAB).tolist()
        assert stop == len(text) or text[stop] in allowed  # the canonical tokenization stays open
        assert allowed and all(row.matcher.deep_copy().consume_token(t) for t in allowed)
    assert allowed == sorted(tokenizer.eos_token_ids)  # a complete object may only end


@pytest.mark.parametrize("vocab", [VOCAB, 100])
def test_apply_bitmask_equals_llguidance_numpy_reference(vocab):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=llg_numpy.get_bitmask_shape(4, vocab), dtype=np.int32)
    bitmask[1] = 0  # a row allowing nothing
    want = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(want, bitmask)
    assert np.array_equal(np.array(apply_bitmask(mx.array(logits), bitmask)), want)


def test_matcher_follows_the_request_history_once_per_token(tokenizer, compiler):
    """Caught up step by step, all at once (a rebuilt state), or asked twice: the same mask; a history
    that shrank is refused, never re-fed."""
    constraint = compiler.compile(json_schema_grammar(PERSON))
    text = ids(tokenizer, json.dumps({"name": "Bo", "age": 7}))
    stepped, masks = constraint.new_row(), llg_numpy.allocate_token_bitmask(3, VOCAB)
    for n in range(1, len(text)):
        stepped.catch_up(text[:n])
        stepped.catch_up(text[:n])  # no new token: nothing is fed again
    stepped.fill(masks, 0)
    rebuilt = constraint.new_row()
    rebuilt.catch_up(text[:-1])
    rebuilt.fill(masks, 1)
    stepped.catch_up(text[:-1])
    stepped.fill(masks, 2)
    assert np.array_equal(masks[0], masks[1]) and np.array_equal(masks[0], masks[2])
    with pytest.raises(ConstraintError, match="shrank"):
        stepped.catch_up(text[:3])
    assert stepped.consumed == len(text) - 1


def test_sampling_params_check_the_constraint(compiler):
    constraint = compiler.compile(json_object_grammar())
    with pytest.raises(ValueError, match="constraint must be a Constraint"):
        SamplingParams(constraint="json")
    with pytest.raises(ValueError, match="ignore_eos=True cannot be combined"):
        SamplingParams(constraint=constraint, ignore_eos=True)
    state = make_state(SamplingParams(constraint=constraint), Request("r", [1], 8))
    assert state.has_processors  # so the runner never samples it ahead of its matcher
    with pytest.raises(ValueError, match="constraints cannot be sampled lazily"):
        LazySample(mx.zeros((1, VOCAB)), [state])


# ---- the batched sampler on a tiny model with SmolLM2's vocabulary -------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(2, vocab_size=VOCAB)


def decode_steps(model, requests: list[Request], states: list, steps: int, check=None) -> list:
    """Sample `steps` tokens for every unfinished request with sample_batch (full forward each step)."""
    results = []
    for _ in range(steps):
        live = [i for i, r in enumerate(requests) if not r.output_token_ids or r.output_token_ids[-1] != 2]
        if not live:
            break
        logits = mx.concatenate([model(mx.array([requests[i].all_token_ids]))[:, -1] for i in live])
        step = sample_batch(logits, [states[i] for i in live])
        for i, result in zip(live, step, strict=True):
            if check:
                check(i, result)
            if result.error is None:
                requests[i].output_token_ids.append(result.token)
        results.append(step)
    return results


def test_constrained_rows_sample_allowed_tokens_and_valid_json(tokenizer, compiler, tiny):
    """Two constrained rows and a free one in one batch: every constrained token is one an independent
    matcher allows, both outputs end with EOS as valid JSON, and the free row samples as it does alone."""
    schemas = [SMALL, PERSON]
    constraints = [compiler.compile(json_schema_grammar(s)) for s in schemas]
    requests = [Request("a", [1, 2, 3], 80), Request("b", [7, 8, 9, 10, 11], 80), Request("c", [4, 5], 80)]
    params = [SamplingParams(constraint=c, seed=i, temperature=1.5) for i, c in enumerate(constraints)]
    constrained = [make_state(p, r) for p, r in zip(params, requests[:2], strict=True)]
    states = [*constrained, make_state(SamplingParams(seed=9), requests[2])]
    checkers = [c.new_row() for c in constraints]
    bitmask = llg_numpy.allocate_token_bitmask(1, VOCAB)

    def check(i, result):
        assert result.error is None, result.error
        if i < 2:
            checkers[i].catch_up(requests[i].output_token_ids)
            checkers[i].fill(bitmask, 0)
            assert result.token in allowed_tokens(bitmask[0], VOCAB)

    decode_steps(tiny, requests, states, 80, check)
    for request, schema in zip(requests[:2], schemas, strict=True):  # the third, unconstrained, is checked below
        assert request.output_token_ids[-1] == 2  # EOS, allowed once the object was complete
        jsonschema.validate(json.loads(tokenizer.decode(request.output_token_ids[:-1])), schema)
    alone = Request("c", [4, 5], 80)
    decode_steps(tiny, [alone], [make_state(SamplingParams(seed=9), alone)], len(requests[2].output_token_ids))
    assert alone.output_token_ids == requests[2].output_token_ids


def only_token_0(tokens, row: mx.array) -> mx.array:
    """A logits processor that masks every token but 0: under a grammar that does not allow 0, nothing is left."""
    return mx.where(mx.arange(row.shape[-1]) == 0, row, -mx.inf)


def test_a_dead_end_fails_only_its_row(tokenizer, compiler, tiny):
    constraint = compiler.compile(json_schema_grammar(PERSON))
    off_grammar = Request("a", [1, 2], 20, output_token_ids=ids(tokenizer, "hello"))  # resumed with bad history
    masked = Request("b", [1, 2], 20)
    free = Request("c", [3, 4], 20)
    states = [
        make_state(SamplingParams(constraint=constraint, seed=1), off_grammar),
        make_state(SamplingParams(constraint=constraint, seed=2, logits_processors=[only_token_0]), masked),
        make_state(SamplingParams(seed=3), free),
    ]
    logits = mx.concatenate([tiny(mx.array([r.all_token_ids]))[:, -1] for r in (off_grammar, masked, free)])
    results = sample_batch(logits, states)
    assert isinstance(results[0].error, ConstraintError) and "leaves the grammar" in str(results[0].error)
    assert isinstance(results[1].error, ConstraintError) and "dead end" in str(results[1].error)
    assert results[2].error is None
    assert results[2].token == sample_batch(logits[2:], states[2:])[0].token


# ---- the engine: continuous batching, n > 1, seeds, preemption, finish reasons, failures ---------------

DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 20, "maxItems": 20}


def tiny_engine(model, tokenizer, **cache) -> Engine:
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    loaded = LoadedModel(model, tokenizer, ModelRef("tiny", "path"), Path("tiny"), "float32", config)
    return Engine(loaded, *split_settings({"cache_tokens": 2048, "block_size": 8, **cache}))


@pytest.fixture(scope="module")
def engine(tiny, tokenizer):
    with tiny_engine(tiny, tokenizer) as eng:
        yield eng


def parsed(completion, schema: dict):
    """The completion's JSON, validated; it must have ended on EOS ("stop")."""
    assert completion.finish_reason == "stop", completion
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


def test_engine_constrained_requests_match_their_solo_runs_batched_forked_and_preempted(tiny, tokenizer, engine):
    constraint = engine.grammar_compiler.compile(json_schema_grammar(DIGITS))
    prompts = [random_tokens(20, seed=s) for s in range(4)]
    params = [SamplingParams(constraint=constraint, seed=s, temperature=1.0, max_tokens=70) for s in range(4)]
    params[1] = dataclasses.replace(params[1], n=2)
    params[3] = SamplingParams(seed=3, max_tokens=37)  # an unconstrained neighbour of another length
    alone = [engine.generate([p], q) for p, q in zip(prompts, params, strict=True)]
    batched = [[c] for c in engine.generate(prompts, params)]
    batched[1:3] = [batched[1] + batched[2]]  # the two sequences of the n = 2 request
    assert [[c.token_ids for c in run] for run in batched] == [[c.token_ids for c in run] for run in alone]
    values = [parsed(c, DIGITS) for run in alone[:3] for c in run]
    assert values[1] != values[2]  # n = 2: two samples, each with its own matcher
    # 4 x ~80 tokens in a pool of 12 blocks of 8: requests are preempted and resumed mid-structure.
    with tiny_engine(tiny, tokenizer, cache_tokens=64, max_num_seqs=4) as tight:
        constraint = tight.grammar_compiler.compile(json_schema_grammar(DIGITS))
        solo = [dataclasses.replace(p, constraint=constraint, n=1) for p in params[:3]]
        got = tight.generate(prompts[:3] * 2, solo * 2)
        assert tight.stats()["preemptions"] > 0
    assert [c.token_ids for c in got] == [alone[i][0].token_ids for i in (0, 1, 2)] * 2


def test_engine_structure_cut_by_max_tokens_finishes_length_and_stop_strings_still_apply(engine):
    constraint = engine.grammar_compiler.compile(json_schema_grammar(DIGITS))
    cut = engine.generate([random_tokens(9)], SamplingParams(constraint=constraint, max_tokens=5, n=2, seed=1))
    assert [c.finish_reason for c in cut] == ["length", "length"]
    for completion in cut:
        with pytest.raises(json.JSONDecodeError):
            json.loads(completion.text)
    # A client's stop string truncates the structure (OpenAI semantics): "[d, ..." stops at the first ", ".
    stopped = engine.generate([random_tokens(9)], SamplingParams(constraint=constraint, stop=[", "], seed=2))[0]
    assert stopped.finish_reason == "stop" and stopped.text[0] == "[" and stopped.text[1:].isdigit()


def test_engine_dead_end_fails_only_that_request(engine):
    constraint = engine.grammar_compiler.compile(json_object_grammar())
    doomed = SamplingParams(constraint=constraint, logits_processors=[only_token_0], max_tokens=8)
    sinks = [queue.Queue(), queue.Queue()]
    engine.submit(random_tokens(6), doomed, sinks[0].put)
    engine.submit(random_tokens(11), SamplingParams(seed=1, max_tokens=12, ignore_eos=True), sinks[1].put)
    with pytest.raises(RequestFailedError, match="dead end"):
        list(drain(sinks[0]))
    assert collect("ok", drain(sinks[1]))[0].finish_reason == "length"


PERSON_PROMPT = [{"role": "user", "content": "Describe a fictional person as JSON with a name, an age and a city."}]
PERSON_REAL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
}


@pytest.mark.slow
def test_real_model_json_schema_outputs_validate_alone_batched_and_reproducibly(default_loaded):
    with Engine(default_loaded, CacheConfig(cache_tokens=4096)) as real:
        constraint = real.grammar_compiler.compile(json_schema_grammar(PERSON_REAL))
        prompt = real.chat_tokens(PERSON_PROMPT)
        params = SamplingParams(constraint=constraint, temperature=0.7, seed=11, n=2, max_tokens=80)
        alone = real.generate([prompt], params)
        people = [parsed(c, PERSON_REAL) for c in alone]
        neighbour = real.chat_tokens([{"role": "user", "content": "Name three rivers."}])
        batched = real.generate([neighbour, prompt], [SamplingParams(temperature=0.0, max_tokens=30), params])
        assert [c.token_ids for c in batched[1:]] == [c.token_ids for c in alone]
        assert people[0] != people[1]
        greedy = dataclasses.replace(params, temperature=0.0, n=1)
        assert parsed(real.generate([prompt], greedy)[0], PERSON_REAL)


def test_grammar_compiler_is_built_once_and_refuses_tokenizers_it_cannot_read(engine):
    assert engine.grammar_compiler is engine.grammar_compiler
    assert engine.grammar_compiler.vocab_size == VOCAB

    class SlowTokenizer:  # a Python-only tokenizer: no `tokenizers` backend to hand llguidance
        eos_token_ids = frozenset({2})

    with pytest.raises(GrammarError, match="needs a Hugging Face fast tokenizer"):
        GrammarCompiler(SlowTokenizer(), VOCAB)
