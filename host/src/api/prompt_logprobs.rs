//! Prompt logprobs in the response shapes: an echoed prompt's legacy completions logprobs (the first token `null`) and vLLM's `prompt_logprobs` lists.

use crate::engine::{PromptLogprob, TokenLogprob};
use crate::model::Tokenizer;

use super::logprobs::{completion_logprobs, finite, token_text};
use super::openai::{CompletionLogprobs, PromptLogprobs, PromptTokenLogprobs, RankedLogprob};

/// What a completions choice with `echo` puts before its output: its prompt as the request
/// gave it (a string as sent, token ids decoded) and the prompt's first token, which has no
/// logprob.
#[derive(Debug, Clone)]
pub struct PromptEcho {
    pub text: String,
    pub first_token: u32,
}

impl PromptEcho {
    /// The legacy logprobs of the echoed prompt, then those of the output, with text offsets
    /// counted in characters of the prompt text followed by the output.
    pub fn logprobs(
        &self,
        tokenizer: &Tokenizer,
        scored: &[PromptLogprob],
        output: &[TokenLogprob],
        num_top: u32,
    ) -> CompletionLogprobs {
        let (first, _) = token_text(tokenizer, self.first_token);
        let mut offset = first.chars().count();
        let mut out = CompletionLogprobs {
            tokens: vec![first],
            token_logprobs: vec![None],
            top_logprobs: vec![None],
            text_offset: vec![0],
        };
        let prompt: Vec<TokenLogprob> = scored.iter().map(as_token_logprob).collect();
        append(
            &mut out,
            completion_logprobs(tokenizer, &prompt, num_top, &mut offset),
        );
        // The output's offsets follow the prompt text as echoed, whatever its tokens decode to.
        let mut offset = self.text.chars().count();
        append(
            &mut out,
            completion_logprobs(tokenizer, output, num_top, &mut offset),
        );
        out
    }
}

fn as_token_logprob(scored: &PromptLogprob) -> TokenLogprob {
    TokenLogprob {
        token: scored.token,
        logprob: scored.logprob,
        top: scored.top.clone(),
    }
}

fn append(out: &mut CompletionLogprobs, more: CompletionLogprobs) {
    out.tokens.extend(more.tokens);
    out.token_logprobs.extend(more.token_logprobs);
    out.top_logprobs.extend(more.top_logprobs);
    out.text_offset.extend(more.text_offset);
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for each one the token
/// itself (with its rank) and the `num_top` most likely tokens (ranks 1 to `num_top`).
pub fn vllm_prompt_logprobs(
    tokenizer: &Tokenizer,
    scored: &[PromptLogprob],
    num_top: u32,
) -> PromptLogprobs {
    let entry = |id: u32, logprob: f32, rank: u32| {
        let entry = RankedLogprob {
            logprob: finite(logprob),
            rank,
            decoded_token: token_text(tokenizer, id).0,
        };
        (id, entry)
    };
    let mut out = Vec::with_capacity(scored.len() + 1);
    out.push(None);
    for row in scored {
        let mut entries = vec![entry(row.token, row.logprob, row.rank)];
        for (i, c) in row.top.iter().take(num_top as usize).enumerate() {
            if c.id != row.token && c.value.is_finite() {
                entries.push(entry(c.id, c.value, i as u32 + 1));
            }
        }
        out.push(Some(PromptTokenLogprobs(entries)));
    }
    out
}
