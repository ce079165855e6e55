//! Compiles constraints against one model's vocabulary, each distinct constraint once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::{ParserFactory, TokenParser};

use crate::model::Tokenizer;

use super::constraint::Constraint;
use super::error::GrammarError;
use super::matcher::GrammarMatcher;
use super::token_env;

/// Distinct constraints kept compiled; past it the oldest is dropped (requests holding it
/// keep their copy).
const CACHE_ENTRIES: usize = 256;

/// A constraint compiled for the model: the parser in its start state, which each request
/// copies into its own [`GrammarMatcher`]. Cloning is cheap.
#[derive(Clone)]
pub struct CompiledGrammar {
    pub(super) parser: Arc<TokenParser>,
    /// Set for a model that reasons first: the grammar starts after the reasoning block.
    after: Option<Arc<ReasoningBlock>>,
}

/// A reasoning block the grammar waits out: it starts with the text after `close`. `open` is
/// set when the model must still open the block; an answer that starts with anything else
/// does not reason, and the grammar applies from its first token on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningBlock {
    pub open: Option<String>,
    pub close: String,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledGrammar")
    }
}

impl CompiledGrammar {
    /// A fresh matcher at the grammar's start. Copies share the lexer's caches, so later
    /// requests of the same schema find its states already built.
    pub fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher::new(TokenParser::clone(&self.parser))
    }

    /// This grammar, starting only after `block`.
    pub fn after_reasoning(mut self, block: ReasoningBlock) -> CompiledGrammar {
        self.after = Some(Arc::new(block));
        self
    }

    /// The reasoning block the grammar waits out, if any.
    pub fn starts_after(&self) -> Option<&ReasoningBlock> {
        self.after.as_deref()
    }
}

type Compiled = Result<CompiledGrammar, GrammarError>;

/// The grammar side of one loaded model: its token environment, built on first use (load
/// starts that on a background thread) and the compile cache keyed by the constraint's digest.
pub struct GrammarCompiler {
    tokenizer: Tokenizer,
    vocab_size: u32,
    eos_token_ids: Vec<u32>,
    factory: OnceLock<Result<ParserFactory, GrammarError>>,
    cache: Mutex<CompileCache>,
}

#[derive(Default)]
struct CompileCache {
    entries: HashMap<[u8; 32], Compiled>,
    /// Keys oldest first, to drop one when full.
    order: VecDeque<[u8; 32]>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

impl GrammarCompiler {
    pub fn new(tokenizer: Tokenizer, vocab_size: u32, eos_token_ids: Vec<u32>) -> GrammarCompiler {
        GrammarCompiler {
            tokenizer,
            vocab_size,
            eos_token_ids,
            factory: OnceLock::new(),
            cache: Mutex::new(CompileCache::default()),
        }
    }

    /// Builds the token environment now, if no caller has yet (the first constrained request
    /// would otherwise wait for it).
    pub fn prepare(&self) -> Result<(), GrammarError> {
        self.factory().map(|_| ())
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        self.factory
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let env = token_env::build(&self.tokenizer, self.vocab_size, &self.eos_token_ids)?;
                let mut factory = ParserFactory::new_simple(&env)
                    .map_err(|e| GrammarError::Unavailable(e.to_string()))?;
                // Errors reach the client in the response; nothing goes to stderr.
                factory.quiet();
                tracing::debug!(
                    vocab = self.vocab_size,
                    ms = started.elapsed().as_millis() as u64,
                    "token environment for constrained decoding built"
                );
                Ok(factory)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The compiled grammar of `constraint`, from the cache when an equal one was compiled.
    pub fn compile(&self, constraint: &Constraint) -> Compiled {
        let key = constraint.cache_key();
        if let Some(hit) = self.lock().entries.get(&key) {
            return hit.clone();
        }
        // Compiled without the lock: a big schema must not hold up other requests' lookups.
        let compiled = self.compile_uncached(constraint);
        let mut cache = self.lock();
        if !cache.entries.contains_key(&key) {
            if cache.entries.len() >= CACHE_ENTRIES
                && let Some(oldest) = cache.order.pop_front()
            {
                cache.entries.remove(&oldest);
            }
            cache.order.push_back(key);
            cache.entries.insert(key, compiled.clone());
        }
        compiled
    }

    fn compile_uncached(&self, constraint: &Constraint) -> Compiled {
        let factory = self.factory()?;
        let parser = factory
            .create_parser(constraint.to_grammar())
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        Ok(CompiledGrammar {
            parser: Arc::new(parser),
            after: None,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CompileCache> {
        // The cache holds no invariant a panic elsewhere could break.
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
