//! Perplexity of a text through the serving engine, with the windows llama.cpp's `llama-perplexity` scores.
//!
//! The text's tokens are cut into windows of `context` tokens. By default the windows follow
//! each other (window `i` is tokens `i·context .. (i+1)·context`; a tail shorter than a window
//! is dropped) and each scores the second half of its tokens: positions `context/2 + 1` to
//! `context - 1`, each from the logits of the position before it, so every scored token has at
//! least half a window of context. With a `stride`, windows start every `stride` tokens
//! (`ceil((tokens - context) / stride)` of them) and each scores its last `stride` tokens
//! (llama-perplexity's `--ppl-stride`). When the tokenizer starts a text with a BOS token,
//! every window's first token is replaced by it, as llama-perplexity does. The perplexity is
//! `exp` of the mean negative log-likelihood of every scored token.
//!
//! Each window is one engine request with no output budget that asks for its prompt
//! logprobs: the engine scores it in its prefill steps, batched with the other windows.

use std::collections::VecDeque;

use plughost_sdk::sampler::SamplingParams;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{EngineError, EngineHandle, GenerationEvent, GenerationRequest};

/// Windows in the engine at once: enough to fill its batches, few enough to keep the queue short.
const IN_FLIGHT: usize = 16;

/// How a text is cut into scored windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    context: usize,
    stride: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("--context must be at least 4 tokens, got {0}")]
    ContextTooSmall(usize),
    #[error("--stride must be between 1 and --context - 1 ({max}), got {stride}")]
    BadStride { stride: usize, max: usize },
    #[error("--context {context} is longer than the model's context of {max_model_len} tokens")]
    ContextTooLong { context: usize, max_model_len: u32 },
    #[error(
        "the text has {tokens} tokens; it needs more than {context} (--context) for one window"
    )]
    TextTooShort { tokens: usize, context: usize },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("window {window}: {message}")]
    Window { window: usize, message: String },
}

impl Windows {
    pub fn new(context: usize, stride: Option<usize>) -> Result<Windows, PerplexityError> {
        if context < 4 {
            return Err(PerplexityError::ContextTooSmall(context));
        }
        if let Some(stride) = stride
            && !(1..context).contains(&stride)
        {
            return Err(PerplexityError::BadStride {
                stride,
                max: context - 1,
            });
        }
        Ok(Windows { context, stride })
    }

    pub fn context(&self) -> usize {
        self.context
    }

    /// Where each window starts in a text of `num_tokens` tokens.
    pub fn starts(&self, num_tokens: usize) -> Vec<usize> {
        match self.stride {
            None => (0..num_tokens / self.context)
                .map(|i| i * self.context)
                .collect(),
            Some(stride) => {
                let count = num_tokens.saturating_sub(self.context).div_ceil(stride);
                (0..count).map(|i| i * stride).collect()
            }
        }
    }

    /// The first position whose logits score the token after it; the window's last position
    /// scores nothing.
    pub fn first_scored(&self) -> usize {
        match self.stride {
            None => self.context / 2,
            Some(stride) => self.context - stride - 1,
        }
    }
}

/// The result of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerplexityReport {
    pub perplexity: f64,
    /// Summed negative log-likelihood of the scored tokens (nats).
    pub negative_log_likelihood: f64,
    pub windows: usize,
    pub scored_tokens: usize,
}

/// Scores `tokens` window by window through `engine`. `bos`, when the tokenizer starts texts
/// with one, replaces each window's first token. `progress` hears after each window how many
/// are done and the perplexity so far.
pub fn perplexity(
    engine: &EngineHandle,
    tokens: &[u32],
    bos: Option<u32>,
    windows: Windows,
    mut progress: impl FnMut(usize, f64),
) -> Result<PerplexityReport, PerplexityError> {
    let max_model_len = engine.summary()?.max_model_len;
    if windows.context > max_model_len as usize {
        return Err(PerplexityError::ContextTooLong {
            context: windows.context,
            max_model_len,
        });
    }
    let starts = windows.starts(tokens.len());
    if starts.is_empty() {
        return Err(PerplexityError::TextTooShort {
            tokens: tokens.len(),
            context: windows.context,
        });
    }
    let mut pending: VecDeque<UnboundedReceiver<GenerationEvent>> = VecDeque::new();
    let mut next = 0;
    let mut nll = 0.0f64;
    let mut scored = 0usize;
    for window in 0..starts.len() {
        while next < starts.len() && pending.len() < IN_FLIGHT {
            let start = starts[next];
            let mut prompt = tokens[start..start + windows.context].to_vec();
            if let Some(bos) = bos {
                prompt[0] = bos;
            }
            pending.push_back(engine.submit(scoring_request(prompt))?.1);
            next += 1;
        }
        let Some(mut events) = pending.pop_front() else {
            break;
        };
        let logprobs = window_logprobs(&mut events)
            .map_err(|message| PerplexityError::Window { window, message })?;
        // Entry k is the logprob of token k + 1, from the logits of position k.
        for logprob in logprobs
            .iter()
            .skip(windows.first_scored())
            .take(windows.context - 1 - windows.first_scored())
        {
            nll -= f64::from(*logprob);
            scored += 1;
        }
        progress(window + 1, (nll / scored.max(1) as f64).exp());
    }
    Ok(PerplexityReport {
        perplexity: (nll / scored.max(1) as f64).exp(),
        negative_log_likelihood: nll,
        windows: starts.len(),
        scored_tokens: scored,
    })
}

/// A request that only scores `prompt`: no output, every prompt logprob, nothing else.
fn scoring_request(prompt: Vec<u32>) -> GenerationRequest {
    GenerationRequest {
        prompt_logprobs: Some(0),
        ..GenerationRequest::new(prompt, SamplingParams::GREEDY, 0)
    }
}

/// The prompt logprobs of one window's request, once it finished.
fn window_logprobs(events: &mut UnboundedReceiver<GenerationEvent>) -> Result<Vec<f32>, String> {
    let mut logprobs = Vec::new();
    while let Some(event) = events.blocking_recv() {
        match event {
            GenerationEvent::Delta {
                prompt_logprobs, ..
            } => logprobs.extend(prompt_logprobs.iter().map(|p| p.logprob)),
            GenerationEvent::Finished { .. } => return Ok(logprobs),
            GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                return Err(message);
            }
            GenerationEvent::Rejected(rejection) => return Err(rejection.to_string()),
        }
    }
    Err("the engine stopped".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_llama_perplexity() {
        let chunks = Windows::new(8, None).expect("valid");
        assert_eq!(chunks.starts(20), vec![0, 8]);
        assert_eq!(chunks.first_scored(), 4);
        let strided = Windows::new(8, Some(3)).expect("valid");
        assert_eq!(strided.starts(20), vec![0, 3, 6, 9]);
        assert_eq!(strided.first_scored(), 4);
        assert!(Windows::new(8, Some(8)).is_err());
        assert!(Windows::new(2, None).is_err());
    }
}
