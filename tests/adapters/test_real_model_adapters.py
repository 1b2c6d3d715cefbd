"""Adapters on the real embedded model (SmolLM2-135M-Instruct): a LoRA and a DoRA adapter in mlx_lm.lora's files,
served together with the base model, each reply token for token what mlx-lm's own `generate_step` gives on
`mlx_lm.load(model, adapter_path=...)`."""

from __future__ import annotations

from mlxpaged.engine.engine import Engine
from mlxpaged.loading.loader import load_model
from mlxpaged.sampling_params import SamplingParams
from tests.tiny_adapters import reference_tokens, write_adapter

import pytest
from mlx_lm import load

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
QUESTIONS = ["What is the capital of France?"]


@pytest.fixture(scope="module")
def setup(default_loaded, tmp_path_factory):
    path = default_loaded.path  # the converted directory mlx-lm loads too
    root = tmp_path_factory.mktemp("adapters")
    make = lambda: load(str(path), lazy=True)[0]  # noqa: E731  (the adapter's own arrays are what is evaluated)
    paths = {
        "lora": write_adapter(make, root / "lora", "lora", seed=1, rank=8, scale=2.0, num_layers=4, base=str(path)),
        "dora": write_adapter(make, root / "dora", "dora", seed=2, rank=4, scale=2.0, num_layers=4, base=str(path)),
    }
    references = {None: default_loaded.model}
    references.update({name: load(str(path), adapter_path=str(p))[0] for name, p in paths.items()})
    with Engine(load_model(), adapters=paths) as engine:  # its own copy: the shared model stays unwrapped
        yield engine, references


def test_real_model_with_adapters_matches_mlx_lm_token_for_token(setup):
    engine, references = setup
    prompts = [engine.chat_tokens([{"role": "user", "content": q}]) for q in QUESTIONS]
    names = [None, "lora", "dora"]
    together = engine.generate([p for p in prompts for _ in names], GREEDY, adapter=names * len(prompts))
    for i, got in enumerate(together):
        name, prompt = names[i % len(names)], prompts[i // len(names)]
        assert got.token_ids == reference_tokens(references[name], prompt, GREEDY.max_tokens), (name, i)
    assert len({tuple(c.token_ids) for c in together[:3]}) == 3  # each adapter changes the reply
