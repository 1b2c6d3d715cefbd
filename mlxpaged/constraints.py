"""Constrained decoding (structured outputs, enforced tool calls) with llguidance.

Three layers:
- grammar builders (`json_schema_grammar`, `json_object_grammar`, `tagged_json_grammar`): pure functions
  returning llguidance grammar text; JSON is laid out exactly as `json.dumps` writes it (", " and ": ",
  no other whitespace), so generated JSON re-renders byte-identically into later prompts (prefix cache);
- `GrammarCompiler`: validates a grammar against the model's tokenizer (GrammarError with llguidance's
  reason) and caches the result as an immutable, shareable `Constraint`;
- `RowConstraint`: one sequence's matcher, advanced with the tokens its request accepted, read through the
  request (so preemption, forks and look-ahead never feed a token twice); `BatchMask` turns the matchers
  of a batch into one bitmask and applies it with plain MLX (llguidance.mlx is Metal-only).
EOS is in a mask only where the grammar may end, so a structure cut short by max_tokens finishes "length".
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mlxpaged.errors import MlxpagedError

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only in llguidance's stubs

log = logging.getLogger(__name__)

# json.dumps' default separators and nothing else: bounded output, byte-identical re-rendering.
JSON_LAYOUT: JsonCompileOptions = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_TAGGED_HEADER = "// mlxpaged tagged_json "  # first line of a tagged grammar: its spec, for the compiler
_CACHE_SIZE = 64  # compiled grammars kept per compiler (a 12-tool grammar takes ~50 ms to build)


class GrammarError(MlxpagedError):
    """A grammar llguidance cannot compile (or a model it cannot constrain); the message is llguidance's reason."""

    def render(self, interface: str = "python", flags=None) -> str:
        return self.template  # llguidance's text may hold braces: no setting placeholders in it


class ConstraintError(RuntimeError):
    """A sequence's output left its grammar (a dead end): its request fails, the batch goes on."""


# ---- grammar builders -------------------------------------------------------------------------------


def _schema_dict(schema: object) -> dict:
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object (dict), got {type(schema).__name__}")
    return schema


def json_schema_grammar(schema: dict, *, strict: bool = True) -> str:
    """One JSON value matching `schema`, in json.dumps layout. strict=False ignores keywords llguidance does
    not implement (OpenAI's non-strict meaning) instead of refusing them."""
    if not isinstance(strict, bool):
        raise GrammarError(f"strict must be True or False, got {strict!r}")
    options: JsonCompileOptions = JSON_LAYOUT if strict else {**JSON_LAYOUT, "lenient": True}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(_schema_dict(schema), overrides=options)
    except (ValueError, TypeError) as exc:  # not JSON-serialisable
        raise GrammarError(f"the schema is not valid JSON: {exc}") from None


def json_object_grammar() -> str:
    """Any JSON object, in json.dumps layout."""
    return json_schema_grammar({"type": "object"})


def tagged_json_grammar(begin: str, end: str, schema: dict, *, lazy: bool, trigger: str | None = None) -> str:
    """`begin` JSON(schema) `end`; lazy: free text until `trigger` (default `begin`) appears, then that.

    Tool schemas compile leniently (unimplemented keywords are not enforced rather than refused). Markers
    that are special tokens of the model's tokenizer are written as tokens by `GrammarCompiler.compile`,
    which reads the spec kept in the first line; the rest is the grammar for markers spelled as text."""
    trigger = begin if trigger is None else trigger
    for name, value in (("begin", begin), ("end", end), ("trigger", trigger)):
        if not isinstance(value, str):
            raise GrammarError(f"{name} must be a string, got {value!r}")
    if lazy and (not trigger or not begin.startswith(trigger)):
        raise GrammarError(f"a lazy grammar needs a non-empty trigger that begins `begin`: {trigger!r}, {begin!r}")
    spec = {"begin": begin, "end": end, "schema": _schema_dict(schema), "lazy": bool(lazy), "trigger": trigger}
    try:
        header = _TAGGED_HEADER + json.dumps(spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the schema is not valid JSON: {exc}") from None
    return header + "\n" + _tagged_lark(spec, lambda text: [text])


def _tagged_lark(spec: dict, pieces: Callable[[str], list]) -> str:
    """The Lark text of a tagged spec; `pieces(text)` splits a marker into text (str) and special token ids."""

    def expr(text: str) -> str:
        return " ".join(
            json.dumps(p, ensure_ascii=False) if isinstance(p, str) else f"<[{p}]>" for p in pieces(text) if p != ""
        )

    schema = {**spec["schema"], "x-guidance": {**JSON_LAYOUT, "lenient": True}}
    trigger, begin = spec["trigger"], spec["begin"]
    if not spec["lazy"]:
        return f"start: {expr(begin)} %json {json.dumps(schema)} {expr(spec['end'])}\n"
    body = f"{expr(begin[len(trigger) :])} %json {json.dumps(schema)} {expr(spec['end'])}"
    if all(isinstance(p, str) for p in pieces(trigger)):  # text trigger: a lazy lexeme ends the free text at it
        tag = f"tag_trig[lazy]: TAG_TEXT {expr(trigger)}\ntag: tag_trig {body}\n"
    else:  # special tokens cannot sit in a lexeme, and free text cannot contain them anyway
        tag = f"tag: TAG_TEXT {expr(trigger)} {body}\n"
    return "%llguidance {}\nstart: tag* TAG_TEXT\nTAG_TEXT: /(.|\\n)*/\n" + tag


# ---- compiling ------------------------------------------------------------------------------------


def _llg_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of an mlx-lm TokenizerWrapper's fast tokenizer, with a bit for every logit."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(
            f"constrained decoding needs a Hugging Face fast tokenizer (the tokenizers library); "
            f"this model's is a {type(inner).__name__}"
        )
    backend = copy.copy(backend)  # as llguidance.hf does: the JSON must not pad or truncate
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ())
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
    except Exception as exc:  # e.g. a vocabulary larger than the logits
        raise GrammarError(f"llguidance cannot use this tokenizer with {vocab_size} logits: {exc}") from None


class GrammarCompiler:
    """Grammar text -> Constraint for one model (tokenizer, logits width). Thread-safe; compiled grammars are
    cached by text (LRU)."""

    def __init__(self, tokenizer, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer (the logits width), got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.tokenizer = _llg_tokenizer(tokenizer, vocab_size)
        self._cache: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Constraint:
        """The Constraint for `grammar` (a builder's text, Lark, or llguidance JSON); GrammarError says why not."""
        if not isinstance(grammar, str):
            raise GrammarError(f"a grammar must be a string, got {type(grammar).__name__}")
        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
        constraint = self._build(grammar)
        with self._lock:
            self._cache[grammar] = constraint
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return constraint

    def _build(self, grammar: str) -> Constraint:
        text = self._specialize(grammar)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "llguidance rejected the grammar")
        for warning in messages:
            log.debug("grammar not fully enforced: %s", warning)  # Constraint.warnings: callers report it in context
        prototype = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if prototype.is_error():
            raise GrammarError(prototype.get_error())
        return Constraint(text, prototype, self.vocab_size, tuple(messages))

    def _specialize(self, grammar: str) -> str:
        """A tagged grammar rewritten with this tokenizer's special tokens; any other grammar as is."""
        if not grammar.startswith(_TAGGED_HEADER):
            return grammar
        try:
            spec = json.loads(grammar[len(_TAGGED_HEADER) :].split("\n", 1)[0])
            return _tagged_lark(spec, self.marker_pieces)
        except (ValueError, KeyError, TypeError) as exc:
            raise GrammarError(f"a tagged grammar's first line is not its spec: {exc!r}") from None

    def marker_pieces(self, text: str) -> list:
        """`text` as runs of plain text (str) and special-token ids (int), as the tokenizer splits it."""
        pieces: list = []
        plain: list[int] = []
        for token in self.tokenizer.tokenize_str(text, parse_special=True):
            if self.tokenizer.is_special_token(token):
                if plain:
                    pieces.append(self.tokenizer.decode_str(plain))
                    plain = []
                pieces.append(token)
            else:
                plain.append(token)
        if plain:
            pieces.append(self.tokenizer.decode_str(plain))
        return pieces


class Constraint:
    """A compiled grammar: immutable and shared by every request using it; each sequence gets its own matcher."""

    def __init__(self, grammar: str, prototype: llguidance.LLMatcher, vocab_size: int, warnings: tuple = ()):
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.warnings = warnings
        self._prototype = prototype  # never advanced: rows start from deep copies

    def new_row(self) -> RowConstraint:
        return RowConstraint(self._prototype.deep_copy(), self.vocab_size)

    def __repr__(self) -> str:
        return f"Constraint({self.grammar[:60]!r}{'...' if len(self.grammar) > 60 else ''})"


class RowConstraint:
    """One sequence's matcher. `catch_up(output)` feeds the output tokens it has not seen yet, so the matcher
    always stands exactly at the request's recorded history, however the engine reached it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0  # output tokens fed to the matcher

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        if len(output_token_ids) < self.consumed:  # the engine never discards a recorded token
            raise ConstraintError(
                f"the output shrank from {self.consumed} to {len(output_token_ids)} tokens under its grammar matcher"
            )
        for position in range(self.consumed, len(output_token_ids)):
            if not self.matcher.consume_token(output_token_ids[position]):
                raise ConstraintError(
                    f"output token {output_token_ids[position]} at position {position} "
                    f"leaves the grammar: {self.error()}"
                )
            self.consumed = position + 1

    def error(self) -> str:
        """The matcher's error, first line (the rest is a state dump and the whole grammar)."""
        return (self.matcher.get_error() or "no error").splitlines()[0]

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit t of word t // 32 set: token t allowed)."""
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar is at a dead end: {self.error()}")
        llg_numpy.fill_next_token_bitmask(self.matcher, bitmask, row)

    @property
    def accepting(self) -> bool:
        """True when the output may end here (EOS is allowed)."""
        return self.matcher.is_accepting()

    def drafted_masks(self, drafts: Sequence[int]) -> list[DraftedPosition]:
        """The constraint at each position of a speculative run [last, *drafts] (runner/draft_verify.py): the mask
        after the history, then after each draft the grammar allows. Past the first draft it forbids, or the one that
        ends the grammar, nothing can be kept: those positions repeat the last mask, so that their throwaway samples
        never read as a dead end. The matcher is left where it was (llguidance's rollback)."""
        masks = llg_numpy.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        valid = self.matcher.validate_tokens(list(drafts))  # how many leading drafts the grammar allows
        self.fill(masks, 0)
        consumed = filled = 0
        while consumed < valid:
            self.matcher.consume_token(drafts[consumed])
            consumed += 1
            if self.matcher.is_stopped():  # the grammar ended: the request ends at this draft
                break
            self.fill(masks, consumed)
            filled = consumed
        self.matcher.rollback(consumed)
        masks[filled + 1 :] = masks[filled]
        return [DraftedPosition(masks[j : j + 1], self.vocab_size, self.consumed + j) for j in range(len(drafts) + 1)]


class DraftedPosition:
    """A row's constraint at one position of a speculative run: its mask, worked out by `drafted_masks`, stands in
    for the matcher (BatchMask.build reads it as a RowConstraint)."""

    def __init__(self, mask: np.ndarray, vocab_size: int, consumed: int):
        self.mask, self.vocab_size, self.consumed = mask, vocab_size, consumed

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Nothing to feed: the mask already stands after the history and the drafts before it."""

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = self.mask[0]


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """`logits` [B, V] with the tokens whose bit is clear in `bitmask` int32 [B, ceil(V / 32)] set to -inf."""
    words = mx.array(bitmask).view(mx.uint32)
    shifts = mx.arange(32, dtype=mx.uint32)  # made per call: MLX arrays belong to their thread's stream
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids one bitmask row allows (numpy; for error messages and tests)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class BatchMask:
    """The bitmask of a batch's constrained rows at this step (the other rows allow everything)."""

    def __init__(self, bitmask: np.ndarray, rows: list[int], vocab_size: int):
        self.bitmask, self.rows, self.vocab_size = bitmask, rows, vocab_size

    @classmethod
    def build(
        cls, constraints: list, sequences: list, vocab_size: int, errors: dict[int, Exception]
    ) -> BatchMask | None:
        """Catch each row's matcher up with its sequence and fill its mask; a row whose matcher fails gets
        its error in `errors`. `constraints[i]` is None for unconstrained rows. None if no row is constrained."""
        rows = [i for i, c in enumerate(constraints) if c is not None and i not in errors]
        if not rows:
            return None
        bitmask = llg_numpy.allocate_token_bitmask(len(constraints), vocab_size)  # all bits set
        for i in rows:
            row = constraints[i]
            try:
                if row.vocab_size != vocab_size:
                    raise ConstraintError(
                        f"the constraint was compiled for {row.vocab_size} logits, the model has {vocab_size}"
                    )
                row.catch_up(sequences[i].output_token_ids)
                row.fill(bitmask, i)
                if not bitmask[i].any():
                    raise ConstraintError(f"the grammar allows no token after {row.consumed} output tokens")
            except ConstraintError as exc:
                errors[i] = exc
        return cls(bitmask, [i for i in rows if i not in errors], vocab_size)

    def apply(self, logits: mx.array) -> mx.array:
        return apply_bitmask(logits, self.bitmask) if self.rows else logits

    def dead_end(self, row: int) -> ConstraintError:
        """The error of a constrained row whose allowed tokens all ended with no finite logit."""
        allowed = allowed_tokens(self.bitmask[row], self.vocab_size)
        return ConstraintError(
            f"constrained decoding reached a dead end: the grammar allows {len(allowed)} "
            f"token(s) here (e.g. {allowed[:5].tolist()}), and the logits processors or "
            f"penalties left none of them a finite logit"
        )
