"""A scripted model: a real llama checkpoint (loadable by path, served like any model) whose next token is a
fixed function of the current one, so it "says" a chosen script at any temperature.

How: hidden size = vocabulary size, the embedding is the identity, the one layer adds nothing (zero
`o_proj` / `down_proj`: the residual stream stays the one-hot embedding), and `lm_head[next(t), t]` is large.
Every token outside the script leads to the script's first piece; the last piece leads to `<|im_end|>` (EOS).
The tokenizer is a `tokenizers` WordLevel model whose script pieces are added tokens (decoded verbatim, joined
by a `Fuse` decoder), so pieces may hold spaces and markers. The chat template mentions `<tool_call>` and
`tool_call.name` (mlx-lm infers its `json_tools` parser) and the vocabulary holds `<think>` / `</think>`
(mlx-lm infers thinking): the shape of a Qwen/Hermes reasoning model, in a few kilobytes.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HIDDEN = 64  # = vocabulary size: one dimension per token
SPECIALS = ["<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# Hermes-style (Qwen 2.5's shape, trimmed): tools listed in the system turn, calls as <tool_call> JSON.
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls %}{% set tool_call = call.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _vocabulary(script: list[str]) -> list[str]:
    pieces = ["[UNK]", *SPECIALS, *MARKERS]
    pieces += [p for p in script if p not in pieces]
    if len(pieces) > HIDDEN:
        raise ValueError(f"a script of {len(script)} pieces needs {len(pieces)} tokens; at most {HIDDEN}")
    return pieces + [f"w{i}" for i in range(HIDDEN - len(pieces))]


def _tokenizer(vocab: list[str], pieces: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    return tokenizer


def _weights(vocab: list[str], script: list[str]) -> dict[str, mx.array]:
    index = {p: i for i, p in enumerate(vocab)}
    successor = {index[a]: index[b] for a, b in itertools.pairwise(script)}
    successor[index[script[-1]]] = index["<|im_end|>"]
    lm_head = mx.zeros((HIDDEN, HIDDEN))
    for token in range(HIDDEN):
        lm_head[successor.get(token, index[script[0]]), token] = 40.0
    zeros, ones = mx.zeros((HIDDEN, HIDDEN)), mx.ones((HIDDEN,))
    layer = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": mx.eye(HIDDEN),
        "model.norm.weight": ones,
        "lm_head.weight": lm_head,
        layer + "input_layernorm.weight": ones,
        layer + "post_attention_layernorm.weight": ones,
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weights[f"{layer}self_attn.{name}.weight"] = zeros
    for name in ("gate_proj", "up_proj", "down_proj"):
        weights[f"{layer}mlp.{name}.weight"] = zeros
    return weights


def write_scripted_model(directory: Path, script: list[str]) -> Path:
    """A model directory whose every reply is `script` (a list of unique pieces) then EOS."""
    if len(set(script)) != len(script):
        raise ValueError("script pieces must be unique: the next token depends on the current one only")
    directory.mkdir(parents=True, exist_ok=True)
    vocab = _vocabulary(script)
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": HIDDEN // 4,
        "vocab_size": HIDDEN,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "eos_token_id": vocab.index("<|im_end|>"),
    }
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), _weights(vocab, script))
    _tokenizer(vocab, MARKERS + [p for p in script if p not in MARKERS]).save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "unk_token": "[UNK]",
        "chat_template": TEMPLATE,
        "model_max_length": 4096,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory
