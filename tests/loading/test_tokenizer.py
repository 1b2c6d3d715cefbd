"""The converted tokenizer encodes exactly like the original SmolLM2 tokenizer."""

from __future__ import annotations

import hashlib

import pytest

# llama.cpp's convert_hf_to_gguf.py encodes this text with each model's original Hugging Face
# tokenizer and records sha256(str(ids)); SmolLM's is 855059...6249 (SmolLM2 shares it: the GGUF
# says tokenizer.ggml.pre = "smollm"). It mixes whitespace runs, emoji with ZWJ, digit runs,
# Khmer, CJK, Cyrillic, repeated punctuation and contractions in odd cases.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
SMOLLM_CHKHSH = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"

# Token strings that follow from the documented pre-tokenizer (digits split one by one, then the
# GPT-2 regex, byte-level with 'Ġ' for a leading space) and the special tokens of the vocabulary.
PIECES = [
    ("2024", ["2", "0", "2", "4"]),
    ("in 1999,", ["in", "Ġ", "1", "9", "9", "9", ","]),
    (" don't", ["Ġdon", "'t"]),
    ("we'll", ["we", "'ll"]),
    ("<|im_start|>user\nHi<|im_end|>", ["<|im_start|>", "user", "Ċ", "Hi", "<|im_end|>"]),
    ("Hello world", ["Hello", "Ġworld"]),
]
SPECIAL_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
ROUND_TRIP = [
    "naïve café, Ünïcödé — “quotes” ‘single’",
    "emoji 🚀🦙👩‍👩‍👧 flags 🇫🇷",
    "tabs\tand\r\nnewlines\n\n",
    "日本語のテキスト",
    "مرحبا بالعالم",
    "x = f(3.14159) ** 2  # code",
    "    indented\n        more",
]


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


def test_llama_cpp_check_text_hashes_like_the_original(tokenizer):
    ids = tokenizer.encode(CHKTXT, add_special_tokens=False)
    assert hashlib.sha256(str(ids).encode()).hexdigest() == SMOLLM_CHKHSH


@pytest.mark.parametrize("text,pieces", PIECES)
def test_pre_tokenizer_pieces(tokenizer, text, pieces):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == pieces


def test_special_tokens_are_single_ids(tokenizer):
    for token, token_id in SPECIAL_IDS.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.eos_token_id == 2
    assert tokenizer.bos_token == "<|im_start|>"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # no BOS added; each turn ends with <|im_end|>
