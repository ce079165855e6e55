//! The model description and step program the runtime prepares, as the host's own types: what model glue returns, free of the plugin boundary's bindings.

/// Element types of tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    I32,
    I64,
    U8,
}

/// A quantity a shape can scale with; the host knows its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// The constant 1, for fixed extents.
    One,
    /// The flattened tokens of the step.
    Tokens,
    /// The sequences in the step.
    Sequences,
    /// The sequences that emit a token this step.
    Emitting,
    /// KV blocks in the pool.
    KvBlocks,
    /// Tokens one KV block holds.
    BlockSize,
    /// The most KV blocks one sequence can hold (a block-table row).
    BlocksPerSequence,
}

/// One dimension of a shape: `factor * extent + offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dim {
    pub extent: Extent,
    pub factor: u64,
    pub offset: u64,
}

/// The geometry of the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

/// What the host needs to know before loading weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The Hugging Face architecture name, e.g. `Qwen3ForCausalLM`.
    pub architecture: String,
    pub vocab_size: u32,
    pub max_position: u32,
    pub eos_token_ids: Vec<u32>,
    pub kv: KvLayout,
    /// Every tensor the checkpoint must provide, with its shape.
    pub weights: Vec<WeightSpec>,
}

/// A weight tensor the checkpoint must provide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightSpec {
    pub name: String,
    pub shape: Vec<u64>,
}

/// How the host keeps a per-step input current in its pooled buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefreshPolicy {
    /// Written from the host before every step (token ids).
    EveryStep,
    /// Written only where rows changed (block-table rows at a page boundary).
    OnChange,
    /// Advanced or derived on the device by a task of the program.
    DeviceMaintained,
}

/// The per-step inputs the host knows how to fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepInputKind {
    TokenIds,
    Positions,
    SeqLens,
    QueryStart,
    BlockTable,
    SlotMapping,
    LogitsIndices,
}

/// A pooled buffer holding one per-step input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepInput {
    pub name: String,
    pub kind: StepInputKind,
    pub dtype: Dtype,
    pub shape: Vec<Dim>,
    pub policy: RefreshPolicy,
}

/// A buffer allocated once at prepare time for intermediate values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scratch {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<Dim>,
}

/// How a task uses a tensor argument; the runtime derives ordering from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgTag {
    /// Read only.
    Input,
    /// Written; the runtime provides the buffer.
    Output,
    /// Read and written.
    Inout,
    /// Written into a buffer that already exists; never allocates.
    OutputExisting,
    /// Excluded from dependency tracking.
    NoDep,
}

/// Where a tensor argument lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BufferRef {
    /// A weight by its checkpoint name.
    Weight(String),
    /// A scratch buffer by name.
    Scratch(String),
    /// A per-step input by name.
    Input(String),
    /// The key cache of a layer.
    KeyCache(u32),
    /// The value cache of a layer.
    ValueCache(u32),
    /// The rows of logits the step returns.
    Logits,
}

/// One tensor argument of a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorArg {
    pub buffer: BufferRef,
    pub tag: ArgTag,
}

/// A scalar parameter of a launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Param {
    Int(i64),
    /// Passed to the device as its IEEE-754 bits.
    Float(f32),
    /// The host's KV block size, unknown to the glue.
    BlockSize,
}

/// One launch of a device callable.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub callable: String,
    pub args: Vec<TensorArg>,
    pub params: Vec<Param>,
}

/// The ordered device work of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepProgram {
    pub inputs: Vec<StepInput>,
    pub scratch: Vec<Scratch>,
    pub tasks: Vec<Task>,
}
