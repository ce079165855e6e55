//! What can go wrong turning a constraint into a grammar or following it.

/// A grammar error; the API layer maps each variant to a status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The schema, regex, choice list or grammar text is not one llguidance can compile; the
    /// message is llguidance's.
    #[error("{0}")]
    Invalid(String),
    /// The model's tokenizer cannot be described to llguidance (its decoder is neither
    /// byte-level nor byte-fallback), so no request of this model can be constrained.
    #[error("constrained decoding is unavailable for this model: {0}")]
    Unavailable(String),
}
