#!/usr/bin/env python3
"""Generate the tiny fixtures of the other model families with Hugging Face `transformers`.

Writes, under tests/fixtures/, with the tiny tokenizer of tiny-qwen3 (run make_fixtures.py first):

* tiny-qwen2/       random Qwen2ForCausalLM (biases on q, k and v), float32
* tiny-mistral/     random MistralForCausalLM with `sliding_window` 256 (longer than any test
                    sequence, and shorter than max_position_embeddings 512)
* tiny-mistral-swa/ the same architecture with `sliding_window` 12, far shorter than the test
                    sequences, so every layer's attention is cut by the window
* tiny-llama3/      random LlamaForCausalLM with Llama 3.1's `rope_type: "llama3"` frequency
                    scaling, its original window (64) small enough that each of the three
                    frequency regimes holds some of a head's pairs
* tiny-qwen3-yarn/  random Qwen3ForCausalLM with `rope_type: "yarn"` (factor 4 over an original
                    window of 32, so the test prompts run past the pretrained window)

each with the same files and references as the fixtures of make_fixtures.py (whose helpers this
script uses). Weight seeds are scanned from a fixed start until the references pass
make_reference's checks (varied continuations, top-2 margins), so the output is deterministic.

    /tmp/refenv/bin/python tests/reference/make_family_fixtures.py [--only tiny-mistral-swa ...]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import make_fixtures
from make_fixtures import FIXTURES, INIT, SEED, init_weights, make_reference, save_checkpoint, write_json

# Biases get the spread of the projections, so a missing bias moves the logits by whole units.
BIAS_STD = 0.3
SEED_TRIES = 40


def common(tok: Tokenizer) -> dict:
    eot = tok.token_to_id("<|endoftext|>")
    return dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        bos_token_id=eot,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=eot,
        initializer_range=0.02,
    )


def families(tok: Tokenizer) -> list[tuple[str, type, object]]:
    c = common(tok)
    qwen2 = Qwen2Config(
        **c,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        max_window_layers=2,
    )
    mistral = MistralConfig(
        **c,
        intermediate_size=160,
        num_hidden_layers=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    llama3 = LlamaConfig(
        **c,
        intermediate_size=160,
        num_hidden_layers=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    yarn = Qwen3Config(
        **c,
        intermediate_size=128,
        num_hidden_layers=2,
        head_dim=32,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=2,
    )
    mistral_swa = MistralConfig(
        **c,
        intermediate_size=160,
        num_hidden_layers=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    return [
        ("tiny-qwen2", Qwen2ForCausalLM, qwen2),
        ("tiny-mistral", MistralForCausalLM, mistral),
        ("tiny-llama3", LlamaForCausalLM, llama3),
        ("tiny-qwen3-yarn", Qwen3ForCausalLM, yarn),
        ("tiny-mistral-swa", MistralForCausalLM, mistral_swa),
    ]


def build(name: str, model_cls, config, tok: Tokenizer, tok_dir: Path, base_seed: int) -> dict:
    """The first seed from `base_seed` whose references pass make_reference's checks."""
    out = FIXTURES / name
    eot = tok.token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>")
    failures = []
    for k in range(SEED_TRIES):
        seed = base_seed + k
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        init_weights(model, seed, **INIT)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param_name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if param_name.endswith(".bias"):
                    param.copy_(BIAS_STD * torch.randn(param.shape, generator=gen))
        model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
        if out.exists():
            shutil.rmtree(out)
        save_checkpoint(model, out, tok_dir, "float32")
        try:
            ref = make_reference(out, model_cls, name, "float32", tok)
        except AssertionError as failure:
            failures.append(f"seed {seed}: {failure}")
            continue
        # make_reference records the seeds of make_fixtures.py's models; this one's is its own.
        ref["init"]["seed"] = seed
        ref["init"]["bias_std"] = BIAS_STD
        ref["generator"] = "tests/reference/make_family_fixtures.py"
        write_json(out / "reference.json", ref)
        return ref
    raise SystemExit(f"{name}: no seed of {SEED_TRIES} passed:\n" + "\n".join(failures))


def check_configs() -> None:
    """What the fixtures are for is in their configs, in both styles."""
    for name, key, expected in [
        ("tiny-mistral", "sliding_window", 256),
        ("tiny-mistral-swa", "sliding_window", 12),
        ("tiny-llama3", "rope_parameters", None),
        ("tiny-qwen3-yarn", "rope_parameters", None),
    ]:
        cfg = json.loads((FIXTURES / name / "config.json").read_text())
        assert key in cfg, (name, key)
        if expected is not None:
            assert cfg[key] == expected, (name, cfg[key])
    v4 = json.loads((FIXTURES / "tiny-qwen3-yarn" / "config.transformers4.json").read_text())
    assert v4["rope_scaling"]["type"] == "yarn" and "rope_type" not in v4["rope_scaling"], v4
    v4 = json.loads((FIXTURES / "tiny-llama3" / "config.transformers4.json").read_text())
    assert v4["rope_scaling"]["rope_type"] == "llama3", v4


def main() -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok_dir = FIXTURES / "tiny-qwen3"
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == make_fixtures.TOKENIZER_VOCAB
    # `--only NAME ...` rebuilds those fixtures alone; seeds stay tied to each family's place.
    only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else None
    for index, (name, model_cls, config) in enumerate(families(tok)):
        if only is not None and name not in only:
            continue
        ref = build(name, model_cls, config, tok, tok_dir, SEED + 7000 + 100 * index)
        lens = [p["num_tokens"] for p in ref["prompts"]]
        distinct = [p["generated_distinct_tokens"] for p in ref["prompts"]]
        print(f"{name}: seed {ref['init']['seed']}, prompt lengths {lens}, distinct generated tokens {distinct}")
    check_configs()


if __name__ == "__main__":
    main()
