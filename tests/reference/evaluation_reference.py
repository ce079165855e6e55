"""Reference values for evaluation through plughost, from `transformers` on the tiny Qwen3 fixture (float32).

Writes tests/fixtures/tiny-qwen3/evaluation.json:

* `loglikelihood`: (context, continuation) pairs as lm-evaluation-harness sends them to
  `/v1/completions` (each part tokenized on its own, the ids concatenated): every prompt
  token's logprob given the tokens before it (`null` for the first), the most likely token
  at each position, and per pair the summed continuation logprob and whether the
  continuation is the greedy one. One continuation is the model's own greedy tokens, so
  `is_greedy` is true there.
* `perplexity`: a text, and its perplexity with llama-perplexity's windowing: windows of
  `context` tokens; by default back to back (`stride` null), each scoring the tokens of its
  second half (positions context/2 + 1 .. context - 1); with a `stride`, windows starting
  every `stride` tokens, each scoring its last `stride` tokens.

The tokenizer adds no BOS token, so no window's first token is replaced.

Run outside CI (see README.md here for the environment):
    python tests/reference/evaluation_reference.py
"""

import json
import math
import pathlib

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "tiny-qwen3"

PAIRS = [
    ("The quick brown fox jumps over the lazy dog, and then", " it sleeps in the sun"),
    ("Question: what is the capital of France?\nAnswer:", " Paris"),
    ("Once upon a time there was a little robot who wanted to", " learn how to paint pictures"),
]
GREEDY_CONTEXT = "In the beginning the model read every word of the"
GREEDY_TOKENS = 4

PERPLEXITY_TEXT = (
    "A language model assigns a probability to every sequence of tokens. Perplexity is the "
    "exponential of the average negative log-likelihood of the tokens of a text, each given "
    "the tokens before it. A model that predicts the text well has a low perplexity; a model "
    "that guesses uniformly over a vocabulary of V tokens has a perplexity of V. Evaluation "
    "tools split a long text into windows that fit the context of the model, and score only "
    "the second half of each window, so every scored token has at least half a window of "
    "context before it. The numbers of two tools agree only when they split the text the "
    "same way, tokenize it the same way and score the same positions of each window. "
    "Quantized weights change the logits a little, and the perplexity shows how much."
)
PERPLEXITY_RUNS = [(64, None), (32, None), (32, 8)]


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(
        ROOT, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = Tokenizer.from_file(str(ROOT / "tokenizer.json"))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    def log_softmax(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, dim=-1)

    pairs = [(encode(c), encode(x)) for c, x in PAIRS]
    context = encode(GREEDY_CONTEXT)
    greedy = []
    for _ in range(GREEDY_TOKENS):
        greedy.append(int(log_softmax(context + greedy)[-1].argmax()))
    pairs.append((context, greedy))

    cases = []
    for ctx, cont in pairs:
        ids = ctx + cont
        lp = log_softmax(ids)
        token_logprobs = [None] + [round(float(lp[i - 1, ids[i]]), 6) for i in range(1, len(ids))]
        top = [None] + [int(lp[i - 1].argmax()) for i in range(1, len(ids))]
        for i in range(len(ctx), len(ids)):
            best = torch.topk(lp[i - 1], 2).values
            assert float(best[0] - best[1]) > 1e-3, "a near-tie at a continuation position"
        cont_lp = [float(lp[i - 1, ids[i]]) for i in range(len(ctx), len(ids))]
        cases.append(
            {
                "token_ids": ids,
                "ctxlen": len(ctx),
                "token_logprobs": token_logprobs,
                "top_ids": top,
                "continuation_logprob": round(sum(cont_lp), 6),
                "is_greedy": all(top[i] == ids[i] for i in range(len(ctx), len(ids))),
            }
        )
    assert cases[-1]["is_greedy"] and not all(c["is_greedy"] for c in cases)
    assert all(len(c["token_ids"]) > 8 for c in cases), "prompts longer than a step's rows"

    tokens = encode(PERPLEXITY_TEXT)
    runs = []
    for n_ctx, stride in PERPLEXITY_RUNS:
        nll, count = 0.0, 0
        if stride is None:
            starts = [i * n_ctx for i in range(len(tokens) // n_ctx)]
            first = n_ctx // 2
        else:
            starts = [i * stride for i in range((len(tokens) - n_ctx + stride - 1) // stride)]
            first = n_ctx - stride - 1
        for start in starts:
            window = tokens[start : start + n_ctx]
            lp = log_softmax(window)
            for j in range(first, n_ctx - 1):
                nll -= float(lp[j, window[j + 1]])
                count += 1
        runs.append(
            {
                "context": n_ctx,
                "stride": stride,
                "windows": len(starts),
                "scored_tokens": count,
                "perplexity": math.exp(nll / count),
            }
        )

    out = {
        "source": "tests/reference/evaluation_reference.py",
        "loglikelihood": cases,
        "perplexity": {"text": PERPLEXITY_TEXT, "num_tokens": len(tokens), "runs": runs},
    }
    (ROOT / "evaluation.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(json.dumps(runs, indent=1))
    print([(c["continuation_logprob"], c["is_greedy"]) for c in cases])


if __name__ == "__main__":
    main()
