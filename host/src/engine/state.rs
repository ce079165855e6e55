//! One request inside the engine: its tokens, progress, KV standing, output state and channel.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::grammar::{GrammarMatcher, ReasoningBlock};
use crate::kv::ComputedPrefix;
use crate::plugins::Generation;
use crate::plugins::generation::LoadedSampler;
use crate::plugins::logits::SeenTokens;
use crate::sched::{Phase, RequestView};

use super::output::OutputText;
use super::prompt_scores::PromptScores;
use super::request::{GenerationEvent, GenerationRequest, PromptLogprob, RequestId};

/// Invariants: `tokens` is `prompt` followed by `output`, and `seen` (kept for requests with
/// penalties) counts exactly those tokens; [`RequestState::push_output`] is the only way an
/// output token comes in.
pub struct RequestState {
    pub id: RequestId,
    pub request: GenerationRequest,
    prompt: Arc<[u32]>,
    output: Vec<u32>,
    /// Prompt and output, the tokens whose KV entries the request needs.
    tokens: Vec<u32>,
    /// The tokens seen so far, counted as they come, for the sampler's penalties; shared with
    /// the step's logits batch while it samples, never copied.
    seen: Option<Arc<SeenTokens>>,
    pub phase: Phase,
    /// Tokens whose KV entries are in the cache.
    pub num_computed: u32,
    /// Prompt tokens the prefix cache supplied at (the last) admission.
    pub num_cached_prefix: u32,
    /// Found at admission, taken by the first allocation.
    pub pending_prefix: Option<ComputedPrefix>,
    /// Blocks after `pending_prefix` that a KV tier below the device supplied, written into
    /// the request's fresh device blocks by its first allocation.
    pub loaded_prefix: Option<LoadedPrefix>,
    pub arrival: Instant,
    /// Microseconds since the engine started, for the scheduler's view.
    pub arrival_us: u64,
    pub first_scheduled: Option<Instant>,
    pub last_token: Option<Instant>,
    /// The output's text: detokenized and held back for stop strings.
    pub text: OutputText,
    pub events: UnboundedSender<GenerationEvent>,
    /// The deployment generation active when the request arrived: held while the request
    /// runs, so the admin listing shows it as draining until its last request ends.
    _deployment: Arc<Generation>,
    /// The sampler of that generation the request chose: it samples every token of the
    /// request, whatever reloads happen meanwhile. `None`: the built-in one, run natively.
    pub sampler: Option<Arc<LoadedSampler>>,
    /// Tokens the host's built-in sampler chose in place of a failed sampler plugin.
    pub sampler_fallback: SamplerFallback,
    /// Where the output stands in the request's grammar; `None` for unconstrained requests,
    /// while the mask worker holds it during a step, and while it waits out a reasoning block.
    pub grammar: Option<Box<GrammarMatcher>>,
    /// The grammar of a request that reasons first, until its reasoning block ends.
    pub dormant_grammar: Option<DormantGrammar>,
    /// The prompt's logprobs as its rows are computed, for a request that asked for them.
    pub prompt_scores: Option<PromptScores>,
}

/// When a request arrived, and the deployment and sampler it was given then.
pub struct Admitted {
    pub arrival: Instant,
    /// Microseconds from the engine's start to `arrival`.
    pub arrival_us: u64,
    pub deployment: Arc<Generation>,
    pub sampler: Option<Arc<LoadedSampler>>,
}

/// How much of a request the built-in sampler served under a sampler's `fallback` policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplerFallback {
    /// The plugin failed this request's own row (found by re-running it alone): the host
    /// samples it natively from then on, so it cannot fault the plugin again.
    pub native_from_now_on: bool,
    /// Tokens sampled natively, for the response's usage.
    pub tokens: u32,
}

impl SamplerFallback {
    /// Counts a sampled token: `fallback` when the built-in sampler chose it in place of the
    /// plugin, `culprit` when the plugin failed on this request's own row.
    pub fn count(&mut self, fallback: bool, culprit: bool) {
        if fallback || self.native_from_now_on {
            self.tokens += 1;
        }
        self.native_from_now_on |= culprit;
    }
}

impl RequestState {
    /// A request as it enters the engine: waiting, nothing computed, nothing generated.
    pub fn new(
        id: RequestId,
        request: GenerationRequest,
        events: UnboundedSender<GenerationEvent>,
        admitted: Admitted,
        text: OutputText,
    ) -> RequestState {
        let Admitted {
            arrival,
            arrival_us,
            deployment,
            sampler,
        } = admitted;
        let prompt: Arc<[u32]> = Arc::from(request.prompt_tokens.clone());
        let seen = (!request.sampling.penalties.is_none())
            .then(|| Arc::new(SeenTokens::from_prompt(&prompt)));
        RequestState {
            id,
            tokens: request.prompt_tokens.clone(),
            prompt,
            output: Vec::new(),
            seen,
            phase: Phase::Waiting,
            num_computed: 0,
            num_cached_prefix: 0,
            pending_prefix: None,
            loaded_prefix: None,
            arrival,
            arrival_us,
            first_scheduled: None,
            last_token: None,
            text,
            events,
            grammar: request
                .constraint
                .as_ref()
                .filter(|grammar| grammar.starts_after().is_none())
                .map(|grammar| Box::new(grammar.matcher())),
            dormant_grammar: request.constraint.as_ref().and_then(|grammar| {
                let block = grammar.starts_after()?.clone();
                Some(DormantGrammar::new(Box::new(grammar.matcher()), block))
            }),
            prompt_scores: request
                .prompt_logprobs
                .map(|k| PromptScores::new(k, request.prompt_tokens.len())),
            request,
            _deployment: deployment,
            sampler,
            sampler_fallback: Default::default(),
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// Reduces the logits `row` of prompt position `position` into the prompt scores, if the
    /// request keeps them.
    pub fn score_prompt_row(&mut self, position: usize, row: &[f32]) {
        if let (Some(scores), Some(&next)) =
            (self.prompt_scores.as_mut(), self.prompt.get(position + 1))
        {
            scores.record(position, row, next);
        }
    }

    /// The prompt's logprobs for the request's first event, once its prompt is computed;
    /// empty for a request without them and after the first call.
    pub fn deliver_prompt_logprobs(&mut self) -> Vec<PromptLogprob> {
        self.prompt_scores
            .as_mut()
            .map(PromptScores::deliver)
            .unwrap_or_default()
    }

    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// Prompt and output.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The tokens seen so far, shared, for a request with penalties.
    pub fn seen_tokens(&self) -> Option<&Arc<SeenTokens>> {
        self.seen.as_ref()
    }

    /// Appends a generated token. The step's logits batch has let go of `seen` by now, so it
    /// is counted in place; were it still shared, it would be copied rather than raced.
    pub fn push_output(&mut self, token: u32) {
        self.output.push(token);
        self.tokens.push(token);
        if let Some(seen) = self.seen.as_mut() {
            Arc::make_mut(seen).push_output(token);
        }
    }

    /// Starts over from `prefix`, the part of its tokens the prefix cache holds: the next
    /// admission allocates from there.
    pub fn take_prefix(&mut self, prefix: ComputedPrefix) {
        self.num_computed = prefix.num_tokens;
        self.num_cached_prefix = prefix.num_tokens;
        self.pending_prefix = (prefix.num_tokens > 0).then_some(prefix);
        self.loaded_prefix = None;
    }

    /// Extends the prefix [`RequestState::take_prefix`] set with `loaded`'s blocks of
    /// `block_size` tokens: they count as computed (and cached) from now on.
    pub fn take_loaded_prefix(&mut self, loaded: LoadedPrefix, block_size: u32) {
        let tokens = loaded.blocks * block_size;
        self.num_computed += tokens;
        self.num_cached_prefix += tokens;
        self.loaded_prefix = (loaded.blocks > 0).then_some(loaded);
    }

    /// The API request's id, for log lines about this sequence.
    pub fn request_id(&self) -> Option<&str> {
        self.request.request_id.as_deref()
    }

    pub fn view(&self, blocks_held: u32) -> RequestView {
        RequestView {
            id: self.id,
            phase: self.phase,
            priority: self.request.priority,
            arrival_us: self.arrival_us,
            prompt_len: self.prompt.len() as u32,
            computed_len: self.num_computed,
            cached_prefix_len: self.num_cached_prefix,
            output_len: self.output.len() as u32,
            max_output: self.request.max_tokens,
            blocks_held,
        }
    }

    /// Whether the client is gone.
    pub fn is_abandoned(&self) -> bool {
        self.events.is_closed()
    }
}

/// Keys and values of whole blocks loaded from a KV tier below the device, waiting for the
/// request's first allocation to give them device blocks.
pub struct LoadedPrefix {
    /// The block index in the request's table where they go: after the device prefix.
    pub first_block: u32,
    pub blocks: u32,
    /// `blocks` blocks' bytes, one after another.
    pub bytes: Vec<u8>,
    /// When the lookup found them, for the load latency.
    pub found: Instant,
}

/// A grammar waiting for the model's reasoning block to end: it starts with the next token.
pub struct DormantGrammar {
    /// Taken when the grammar starts.
    matcher: Option<Box<GrammarMatcher>>,
    block: ReasoningBlock,
    /// The output's text so far, trimmed to what a marker split across pieces needs.
    seen: String,
    /// Whether any output text came yet (an open marker must come first).
    started: bool,
}

impl DormantGrammar {
    pub fn new(matcher: Box<GrammarMatcher>, block: ReasoningBlock) -> DormantGrammar {
        DormantGrammar {
            matcher: Some(matcher),
            block,
            seen: String::new(),
            started: false,
        }
    }

    /// Reads the next piece of output; gives the matcher back once the grammar applies: after
    /// the block's end, or at once when the answer does not open a block it had to open.
    pub fn read(&mut self, text: &str) -> Option<Box<GrammarMatcher>> {
        self.seen.push_str(text);
        let trimmed = self.seen.trim_start();
        if !self.started {
            if trimmed.is_empty() {
                return None;
            }
            if let Some(open) = &self.block.open {
                if open.starts_with(trimmed) && trimmed.len() < open.len() {
                    return None;
                }
                if !trimmed.starts_with(open.as_str()) {
                    return self.matcher.take();
                }
            }
            self.started = true;
        }
        if self.seen.contains(&self.block.close) {
            return self.matcher.take();
        }
        let keep = self.block.close.len();
        if self.seen.len() > keep {
            let mut cut = self.seen.len() - keep;
            while !self.seen.is_char_boundary(cut) {
                cut -= 1;
            }
            self.seen.drain(..cut);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the grammar starts at the end of `pieces` (the last one that made it start).
    fn starts_at(block: ReasoningBlock, pieces: &[&str]) -> Option<usize> {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3");
        let tokenizer = crate::model::Tokenizer::from_dir(&dir).expect("tokenizer");
        let compiler = crate::grammar::GrammarCompiler::new(tokenizer, 448, vec![447]);
        let compiled = compiler
            .compile(&crate::grammar::Constraint::JsonObject)
            .expect("compiles");
        let mut dormant = DormantGrammar::new(Box::new(compiled.matcher()), block);
        pieces.iter().position(|p| dormant.read(p).is_some())
    }

    #[test]
    fn the_grammar_starts_after_the_block_ends_even_split_across_pieces() {
        let inside = ReasoningBlock {
            open: None,
            close: "</think>".into(),
        };
        assert_eq!(
            starts_at(inside.clone(), &["hmm, ", "so </th", "ink>", "\n\n{"]),
            Some(2)
        );
        assert_eq!(starts_at(inside.clone(), &["still thinking", " é"]), None);
        let opening = ReasoningBlock {
            open: Some("<think>".into()),
            close: "</think>".into(),
        };
        assert_eq!(
            starts_at(opening.clone(), &["\n<thi", "nk>x", "</think>"]),
            Some(2)
        );
        // An answer that does not open the block it had to open is constrained at once.
        assert_eq!(starts_at(opening, &["{\"a\""]), Some(0));
    }
}
