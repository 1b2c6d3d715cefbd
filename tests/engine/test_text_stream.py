"""TextStream with the real tokenizer of the default model: stop strings, EOS, lengths, UTF-8."""

from __future__ import annotations

from mlxpaged.engine.text_stream import Delta, TextStream
from mlxpaged.sampling_params import SamplingParams

import pytest

SENTENCE = "The capital of France is Paris."
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(tokenizer, tokens: list[int], **params) -> tuple[TextStream, list[Delta]]:
    """Push tokens until the stream finishes; the deltas include a final finish() if needed."""
    stream = TextStream(tokenizer, SamplingParams(**params), tokenizer.eos_token_ids)
    deltas = []
    for token in tokens:
        deltas.append(stream.push(token))
        if deltas[-1].finished:
            break
    if not stream.finished:
        deltas.append(stream.finish())
    check_invariants(stream, deltas)
    return stream, deltas


def check_invariants(stream: TextStream, deltas: list[Delta]) -> None:
    finished = [i for i, delta in enumerate(deltas) if delta.finished]
    assert finished == [len(deltas) - 1]  # exactly one finished delta, and it is the last
    assert "".join(delta.text for delta in deltas) == stream.text
    assert all("\ufffd" not in delta.text for delta in deltas)


def test_the_sentence_tokenizes_as_these_tests_assume(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(encode(tokenizer, SENTENCE))
    assert pieces == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", "."]


def test_no_stop_streams_everything_and_finish_has_no_reason(tokenizer):
    stream, deltas = run(tokenizer, encode(tokenizer, SENTENCE))
    assert stream.text == SENTENCE
    assert deltas[-1] == Delta("", True, None, None)


@pytest.mark.parametrize(
    "stop,before",
    [
        ("France is", "The capital of "),  # spans two tokens
        ("capital of France", "The "),  # spans three tokens
        ("apit", "The c"),  # inside one token
        ("s Paris", "The capital of France i"),  # starts mid-token, ends at a token's end
    ],
)
def test_stop_string_emits_only_the_text_before_it(tokenizer, stop, before):
    tokens = encode(tokenizer, SENTENCE)
    stream, deltas = run(tokenizer, tokens + tokens, stop=stop)
    assert stream.text == before
    assert (deltas[-1].finish_reason, deltas[-1].stop_matched) == ("stop", stop)
    assert stream.num_tokens < len(tokens)  # it stopped at the completing token, not later


def test_text_is_never_emitted_past_a_stop_that_is_still_forming(tokenizer):
    stream = TextStream(tokenizer, SamplingParams(stop="France is"), tokenizer.eos_token_ids)
    texts = [stream.push(token).text for token in encode(tokenizer, SENTENCE)[:4]]
    assert texts == ["The", " capital", " of", " "]  # "France" is held back: it may begin the stop


def test_stop_at_the_very_start(tokenizer):
    _stream, deltas = run(tokenizer, encode(tokenizer, SENTENCE), stop="The")
    assert deltas == [Delta("", True, "stop", "The")]


def test_overlapping_stop_strings_the_earliest_wins(tokenizer):
    tokens = encode(tokenizer, SENTENCE)
    stream, deltas = run(tokenizer, tokens, stop=["France is", "of France"])
    assert stream.text == "The capital "
    assert deltas[-1].stop_matched == "of France"
    # A longer candidate that never completes does not block a shorter one that does.
    stream, deltas = run(tokenizer, tokens, stop=["is Paris!", "is P"])
    assert stream.text == "The capital of France "
    assert deltas[-1].stop_matched == "is P"


def test_stop_that_never_completes_releases_the_held_text(tokenizer):
    tokens = encode(tokenizer, "The capital of France is Paris")
    stream, deltas = run(tokenizer, tokens, stop="Paris!")
    assert deltas[-1] == Delta("Paris", True, None, None)  # held until finish() flushed it
    assert stream.text == "The capital of France is Paris"
    stream, deltas = run(tokenizer, tokens + encode(tokenizer, "."), stop="Paris!")
    assert stream.text == "The capital of France is Paris."  # released once "." ruled the stop out


def test_held_text_is_flushed_at_max_tokens(tokenizer):
    tokens = encode(tokenizer, "The capital of France is Paris")
    stream, deltas = run(tokenizer, tokens, stop="Paris!", max_tokens=len(tokens))
    assert deltas[-1] == Delta(" Paris", True, "length", None)  # " " and "Paris" arrive together
    assert stream.text == "The capital of France is Paris"


def test_stop_string_in_the_last_allowed_token_wins_over_length(tokenizer):
    tokens = encode(tokenizer, SENTENCE)
    stream, deltas = run(tokenizer, tokens, stop="Paris", max_tokens=6)
    assert (stream.text, deltas[-1].finish_reason) == ("The capital of France is ", "stop")


def test_max_tokens_finishes_with_length(tokenizer):
    stream, deltas = run(tokenizer, encode(tokenizer, SENTENCE), max_tokens=3)
    assert stream.text == "The capital of"
    assert (deltas[-1].finish_reason, stream.num_tokens) == ("length", 3)
    with pytest.raises(RuntimeError, match="finished"):
        stream.push(encode(tokenizer, " more")[0])
    assert stream.finish() == Delta("", True, "length", None)


def test_eos_stops_without_its_text_and_flushes_held_text(tokenizer):
    assert tokenizer.eos_token_ids == {EOS}
    tokens = [*encode(tokenizer, "The capital of France is Paris"), EOS, *encode(tokenizer, " more")]
    stream, deltas = run(tokenizer, tokens, stop="Paris!")
    assert stream.text == "The capital of France is Paris"
    assert deltas[-1] == Delta("Paris", True, "stop", None)
    assert stream.num_tokens == 7


def test_ignore_eos_keeps_going(tokenizer):
    tokens = [*encode(tokenizer, "Paris"), EOS, *encode(tokenizer, " again")]
    stream, deltas = run(tokenizer, tokens, ignore_eos=True)
    assert stream.text == "Paris<|im_end|> again"  # mlx-lm's detokenizer keeps special tokens
    assert deltas[-1].finish_reason is None


def test_stop_token_ids_stop_without_their_text(tokenizer):
    tokens = encode(tokenizer, SENTENCE)
    stream, deltas = run(tokenizer, tokens, stop_token_ids=[tokens[5]])  # " Paris"
    assert stream.text == "The capital of France is"
    assert deltas[-1].finish_reason == "stop"
    # stop_token_ids still apply when EOS is ignored.
    stream, _ = run(tokenizer, tokens, stop_token_ids=[tokens[5]], ignore_eos=True)
    assert stream.text == "The capital of France is"


@pytest.mark.parametrize("text", ["Hello world! 🚀🦙 naïve 日本語", "👩\u200d👩\u200d👧 flags 🇫🇷 done"])
def test_multibyte_characters_split_across_tokens_come_out_whole(tokenizer, text):
    tokens = encode(tokenizer, text)
    assert len(tokens) > len(text.split())  # some characters really are split across tokens
    stream, deltas = run(tokenizer, tokens)
    assert stream.text == text
    assert any(delta.text == "" for delta in deltas[:-1])  # partial characters were held back


def test_stop_string_made_of_multibyte_characters(tokenizer):
    stream, deltas = run(tokenizer, encode(tokenizer, "Hello world! 🚀🦙 naïve"), stop="🦙")
    assert (stream.text, deltas[-1].stop_matched) == ("Hello world! 🚀", "🦙")


def test_each_stream_has_its_own_detokenizer(tokenizer):
    params = SamplingParams()
    first = TextStream(tokenizer, params, tokenizer.eos_token_ids)
    second = TextStream(tokenizer, params, tokenizer.eos_token_ids)
    for a, b in zip(encode(tokenizer, "The capital"), encode(tokenizer, "Hello world"), strict=True):
        first.push(a)
        second.push(b)
    first.finish(), second.finish()
    assert (first.text, second.text) == ("The capital", "Hello world")


def test_finish_on_abort_flushes_a_partial_stop(tokenizer):
    stream = TextStream(tokenizer, SamplingParams(stop="is Paris"), tokenizer.eos_token_ids)
    assert [stream.push(token).text for token in encode(tokenizer, "France is")] == ["France", " "]
    assert stream.finish() == Delta("is", True, None, None)
    assert stream.text == "France is"


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="params"):
        TextStream(tokenizer, {"stop": "x"}, {EOS})
    with pytest.raises(ValueError, match="TokenizerWrapper"):
        TextStream(object(), SamplingParams(), {EOS})


def test_completions_keep_the_first_words_space_chat_replies_drop_it(tokenizer):
    tokens = encode(tokenizer, " Paris.")
    assert run(tokenizer, tokens)[0].text == "Paris."
    assert run(tokenizer, tokens, trim_leading_space=False)[0].text == " Paris."


def test_a_sentencepiece_detokenizer_keeps_the_space_too():
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer

    class Vocab:  # the two calls SPMStreamingDetokenizer makes
        pieces = ("\u2581Paris", ".")

        def __len__(self):
            return len(self.pieces)

        def convert_ids_to_tokens(self, ids):
            return [self.pieces[i] for i in ids]

    class Wrapper:
        @property
        def detokenizer(self):
            return SPMStreamingDetokenizer(Vocab())

    for trim, text in ((True, "Paris."), (False, " Paris.")):
        stream = TextStream(Wrapper(), SamplingParams(trim_leading_space=trim), [])
        for token in (0, 1):
            stream.push(token)
        assert stream.finish() is not None and stream.text == text


@pytest.mark.parametrize("text", [SENTENCE, "naïve café 你好 🙂 end", " leading  spaces\n\nand lines "])
def test_without_stop_strings_release_is_the_stop_string_path(tokenizer, text):
    """With no stop strings `_release` hands over all held text at once; the general path (`_release_stops`,
    which looks for stops and holds back their prefixes) must give the same deltas."""
    tokens = encode(tokenizer, text)
    fast, fast_deltas = run(tokenizer, tokens, max_tokens=len(tokens) + 1)
    slow = TextStream(tokenizer, SamplingParams(max_tokens=len(tokens) + 1), tokenizer.eos_token_ids)
    slow._release = slow._release_stops  # type: ignore[method-assign]
    slow_deltas = [slow.push(token) for token in tokens] + [slow.finish()]
    assert fast_deltas == slow_deltas and fast.text == slow.text
    assert fast.text.strip() == text.strip()  # the first word's space may be trimmed (trim_leading_space)
