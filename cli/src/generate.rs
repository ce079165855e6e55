//! `plughost generate`: one completion through the engine, streamed to stdout.

use std::io::Write;
use std::sync::Arc;

use plughost::engine::{EngineHandle, GenerationEvent, GenerationRequest, StopConditions};
use plughost::metrics::Metrics;
use plughost::model::ChatMessage;
use plughost_sdk::sampler::SamplingParams;

use crate::error::CliError;
use crate::options::ModelArgs;

/// The `generate` options besides the model's.
pub struct GenerateArgs<'a> {
    pub prompt: &'a str,
    pub chat: bool,
    pub max_tokens: u32,
    pub temperature: f32,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
}

/// `plughost generate`: one completion through the same engine `serve` runs, printed as it streams.
pub fn generate(model: &ModelArgs, args: GenerateArgs<'_>) -> Result<(), CliError> {
    let engine = EngineHandle::start(model.setup()?, Arc::new(Metrics::new()))?;
    let summary = engine.wait_ready()?;
    let text = if args.chat {
        let template = summary
            .chat_template
            .as_ref()
            .ok_or(CliError::NoChatTemplate)?;
        template.render(&[ChatMessage::new("user", args.prompt)], true)?
    } else {
        args.prompt.to_string()
    };
    let prompt_tokens = summary.tokenizer.encode(&text, !args.chat)?;
    if prompt_tokens.is_empty() {
        return Err(CliError::EmptyPrompt);
    }
    let room = summary
        .max_model_len
        .saturating_sub(prompt_tokens.len() as u32);
    if room == 0 {
        return Err(CliError::PromptTooLong {
            tokens: prompt_tokens.len(),
            context: summary.max_model_len,
        });
    }
    let request = GenerationRequest {
        stop: StopConditions {
            ignore_eos: args.ignore_eos,
            ..Default::default()
        },
        ..GenerationRequest::new(
            prompt_tokens,
            SamplingParams {
                temperature: args.temperature,
                seed: args.seed.unwrap_or_else(rand::random),
                ..SamplingParams::GREEDY
            },
            args.max_tokens.min(room),
        )
    };
    let submitted = std::time::Instant::now();
    let (_, mut events) = engine.submit(request)?;
    let mut first_token = None;
    let mut stdout = std::io::stdout().lock();
    while let Some(event) = events.blocking_recv() {
        match event {
            GenerationEvent::Delta { text, .. } => {
                first_token.get_or_insert_with(std::time::Instant::now);
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
            GenerationEvent::Finished { reason, usage } => {
                let _ = writeln!(stdout);
                let ttft = first_token.map(|t| t - submitted).unwrap_or_default();
                let decode = first_token.map(|t| t.elapsed()).unwrap_or_default();
                let decode_rate = usage.completion_tokens.saturating_sub(1) as f64
                    / decode.as_secs_f64().max(1e-9);
                eprintln!(
                    "[{} prompt tokens, {} generated, finish reason {}; time to first token {:.3} s, decode {:.1} tokens/s]",
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    reason.as_str(),
                    ttft.as_secs_f64(),
                    decode_rate
                );
                break;
            }
            GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                return Err(CliError::Generation(message));
            }
            GenerationEvent::Rejected(rejection) => return Err(rejection.into()),
        }
    }
    engine.shutdown();
    Ok(())
}
