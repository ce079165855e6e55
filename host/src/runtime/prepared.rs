//! The prepared runtime: device buffers for weights, KV cache, scratch and step inputs, and the resolved task list.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::kv_blocks::KvBlockLayout;
use super::program::{self, BufferRef, Dim, Extent, ModelInfo, Param, StepInputKind, StepProgram};
use crate::device::{ArgTag, BufferId, CallableIndex, DType, Device, TensorArg};

use super::RuntimeError;
use super::deps::TaskGraph;
use super::extents::Extents;
use super::refresh::{InputKind, InputMirror};
use super::step::{StepLimits, StepSequence, StepStaging, StepTiming};

/// Sizes the runtime is prepared for; nothing grows after `prepare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Most sequences in one step.
    pub max_num_seqs: u32,
    /// Most tokens (prefill and decode together) in one step.
    pub max_num_batched_tokens: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks in the pool.
    pub num_kv_blocks: u32,
    /// Most tokens one sequence may hold (prompt and output).
    pub max_model_len: u32,
    /// The element type of the KV cache: f32, f16 or bf16.
    pub kv_cache_dtype: DType,
}

/// A weight as the checkpoint holds it: dtype, shape and raw little-endian bytes (rows in
/// the order the model reads them; for block-quantized dtypes, rows of whole blocks).
pub struct WeightView<'a> {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: std::borrow::Cow<'a, [u8]>,
}

/// Where `prepare` reads weights from (a memory-mapped checkpoint, or a test's tensors).
pub trait WeightSource {
    fn weight(&self, name: &str) -> Result<WeightView<'_>, RuntimeError>;

    /// Weight `name` is now in device memory; the source may let go of its own copy.
    fn uploaded(&self, _name: &str) {}
}

/// A device buffer with its dtype and symbolic shape.
#[derive(Debug, Clone)]
struct Buffer {
    id: BufferId,
    dtype: DType,
    shape: Vec<Dim>,
}

#[derive(Debug)]
struct PreparedTask {
    callable: CallableIndex,
    args: Vec<(Buffer, ArgTag)>,
    params: Vec<i64>,
}

/// Pooled buffers of the step inputs the host refreshes.
#[derive(Debug, Default)]
struct StepInputBuffers {
    token_ids: Option<BufferId>,
    query_start: Option<BufferId>,
    seq_lens: Option<BufferId>,
    block_table: Option<BufferId>,
    logits_indices: Option<BufferId>,
}

/// A model prepared on a device.
pub struct Runtime {
    pub(super) device: Device,
    info: ModelInfo,
    limits: StepLimits,
    tasks: Vec<PreparedTask>,
    inputs: StepInputBuffers,
    logits: BufferId,
    owned: Vec<BufferId>,
    staging: StepStaging,
    graph: TaskGraph,
    mirror: InputMirror,
    write_bytes: Vec<u8>,
    launch_args: Vec<TensorArg>,
    /// Where each KV block lies in the caches, for the tiers' batched copies.
    pub(super) kv_blocks: KvBlockLayout,
}

fn dtype(d: program::Dtype) -> DType {
    match d {
        program::Dtype::F32 => DType::F32,
        program::Dtype::F16 => DType::F16,
        program::Dtype::Bf16 => DType::BF16,
        program::Dtype::I32 => DType::I32,
        program::Dtype::I64 => DType::I64,
        program::Dtype::U8 => DType::U8,
    }
}

fn tag(t: program::ArgTag) -> ArgTag {
    match t {
        program::ArgTag::Input => ArgTag::Input,
        program::ArgTag::Output => ArgTag::Output,
        program::ArgTag::Inout => ArgTag::Inout,
        program::ArgTag::OutputExisting => ArgTag::OutputExisting,
        program::ArgTag::NoDep => ArgTag::NoDep,
    }
}

fn fixed(values: &[u64]) -> Vec<Dim> {
    values
        .iter()
        .map(|&v| Dim {
            extent: Extent::One,
            factor: v,
            offset: 0,
        })
        .collect()
}

/// Collects buffers as they are allocated so a failed prepare frees them all.
struct Allocations<'d> {
    device: &'d mut Device,
    owned: Vec<BufferId>,
}

impl Allocations<'_> {
    fn alloc(&mut self, bytes: u64) -> Result<BufferId, RuntimeError> {
        // Zero-sized buffers still need an id; one element keeps every device happy.
        let id = self.device.alloc(bytes.max(4))?;
        self.owned.push(id);
        Ok(id)
    }

    fn release(self) {
        for id in self.owned {
            let _ = self.device.free(id);
        }
    }
}

impl RuntimeConfig {
    fn max_extents(&self) -> Result<Extents, RuntimeError> {
        let positive = [
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("block_size", self.block_size),
            ("num_kv_blocks", self.num_kv_blocks),
            ("max_model_len", self.max_model_len),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(RuntimeError::Config(format!("{name} must be positive")));
        }
        Ok(Extents {
            tokens: self.max_num_batched_tokens as u64,
            sequences: self.max_num_seqs as u64,
            emitting: self.max_num_seqs as u64,
            kv_blocks: self.num_kv_blocks as u64,
            block_size: self.block_size as u64,
            blocks_per_sequence: (self.max_model_len as u64).div_ceil(self.block_size as u64),
        })
    }
}

fn bytes_of(buffer_dtype: DType, elements: u64) -> u64 {
    elements.saturating_mul(buffer_dtype.size_bytes())
}

impl Runtime {
    /// Prepares `program` on `device`: uploads every weight `info` lists, allocates the KV
    /// cache and every buffer once. On failure every buffer allocated so far is freed.
    pub fn prepare(
        mut device: Device,
        info: ModelInfo,
        program: &StepProgram,
        weights: &dyn WeightSource,
        config: RuntimeConfig,
    ) -> Result<Runtime, (Device, RuntimeError)> {
        let mut allocations = Allocations {
            device: &mut device,
            owned: Vec::new(),
        };
        match Self::prepare_buffers(&mut allocations, &info, program, weights, config) {
            Ok(parts) => {
                let owned = std::mem::take(&mut allocations.owned);
                Ok(Runtime::assemble(device, info, config, parts, owned))
            }
            Err(e) => {
                allocations.release();
                Err((device, e))
            }
        }
    }

    fn prepare_buffers(
        alloc: &mut Allocations<'_>,
        info: &ModelInfo,
        program: &StepProgram,
        weights: &dyn WeightSource,
        config: RuntimeConfig,
    ) -> Result<PreparedParts, RuntimeError> {
        let max = config.max_extents()?;
        let mut named: HashMap<String, Buffer> = HashMap::new();
        let mut weight_buffers: HashMap<String, Buffer> = HashMap::new();
        for spec in &info.weights {
            let view = weights.weight(&spec.name)?;
            if view.shape != spec.shape {
                return Err(RuntimeError::Weight(format!(
                    "weight {} has shape {:?}, the model needs {:?}",
                    spec.name, view.shape, spec.shape
                )));
            }
            let id = alloc.alloc(view.bytes.len() as u64)?;
            alloc.device.write(id, 0, &view.bytes)?;
            weights.uploaded(&spec.name);
            weight_buffers.insert(
                spec.name.clone(),
                Buffer {
                    id,
                    dtype: view.dtype,
                    shape: fixed(&spec.shape),
                },
            );
        }
        // `[B, Hk, bs, D]`, the device ABI's cache layout.
        let kv_shape = vec![
            Dim {
                extent: Extent::KvBlocks,
                factor: 1,
                offset: 0,
            },
            Dim {
                extent: Extent::One,
                factor: info.kv.num_kv_heads as u64,
                offset: 0,
            },
            Dim {
                extent: Extent::BlockSize,
                factor: 1,
                offset: 0,
            },
            Dim {
                extent: Extent::One,
                factor: info.kv.head_dim as u64,
                offset: 0,
            },
        ];
        let mut shape_buf = [0u64; 4];
        let kv_elements = max.resolve_shape(&kv_shape, &mut shape_buf);
        let mut kv = Vec::new();
        for _ in 0..info.kv.num_layers {
            let k = alloc.alloc(bytes_of(config.kv_cache_dtype, kv_elements))?;
            let v = alloc.alloc(bytes_of(config.kv_cache_dtype, kv_elements))?;
            kv.push((k, v));
        }
        let mut inputs = StepInputBuffers::default();
        for input in &program.inputs {
            check_rank(&input.name, &input.shape)?;
            let d = dtype(input.dtype);
            let id = alloc.alloc(bytes_of(d, max.resolve_shape(&input.shape, &mut shape_buf)))?;
            let slot = match input.kind {
                StepInputKind::TokenIds => Some(&mut inputs.token_ids),
                StepInputKind::QueryStart => Some(&mut inputs.query_start),
                StepInputKind::SeqLens => Some(&mut inputs.seq_lens),
                StepInputKind::BlockTable => Some(&mut inputs.block_table),
                StepInputKind::LogitsIndices => Some(&mut inputs.logits_indices),
                // Derived on the device by the program's own tasks.
                StepInputKind::Positions | StepInputKind::SlotMapping => None,
            };
            if let Some(slot) = slot {
                if d != DType::I32 {
                    return Err(RuntimeError::Program(format!(
                        "step input {} must be i32",
                        input.name
                    )));
                }
                *slot = Some(id);
            }
            named.insert(
                format!("input:{}", input.name),
                Buffer {
                    id,
                    dtype: d,
                    shape: input.shape.clone(),
                },
            );
        }
        for scratch in &program.scratch {
            check_rank(&scratch.name, &scratch.shape)?;
            let d = dtype(scratch.dtype);
            let id = alloc.alloc(bytes_of(
                d,
                max.resolve_shape(&scratch.shape, &mut shape_buf),
            ))?;
            named.insert(
                format!("scratch:{}", scratch.name),
                Buffer {
                    id,
                    dtype: d,
                    shape: scratch.shape.clone(),
                },
            );
        }
        let logits_shape = vec![
            Dim {
                extent: Extent::Emitting,
                factor: 1,
                offset: 0,
            },
            Dim {
                extent: Extent::One,
                factor: info.vocab_size as u64,
                offset: 0,
            },
        ];
        let logits = alloc.alloc(bytes_of(
            DType::F32,
            max.resolve_shape(&logits_shape, &mut shape_buf),
        ))?;
        let resolver = BufferResolver {
            named: &named,
            weights: &weight_buffers,
            kv: &kv[..],
            kv_shape: &kv_shape,
            kv_dtype: config.kv_cache_dtype,
            logits: Buffer {
                id: logits,
                dtype: DType::F32,
                shape: logits_shape.clone(),
            },
        };
        let mut tasks = Vec::with_capacity(program.tasks.len());
        for (i, task) in program.tasks.iter().enumerate() {
            let callable = alloc.device.callable_index(&task.callable)?;
            let mut args = Vec::with_capacity(task.args.len());
            for arg in &task.args {
                let buffer = resolver.resolve(&arg.buffer).map_err(|e| {
                    RuntimeError::Program(format!("task {i} ({}): {e}", task.callable))
                })?;
                args.push((buffer, tag(arg.tag)));
            }
            let params = task
                .params
                .iter()
                .map(|p| match p {
                    Param::Int(v) => *v,
                    Param::Float(f) => f.to_bits() as i64,
                    Param::BlockSize => config.block_size as i64,
                })
                .collect();
            tasks.push(PreparedTask {
                callable,
                args,
                params,
            });
        }
        let missing = [
            ("token-ids", inputs.token_ids.is_none()),
            ("query-start", inputs.query_start.is_none()),
            ("seq-lens", inputs.seq_lens.is_none()),
            ("block-table", inputs.block_table.is_none()),
            ("logits-indices", inputs.logits_indices.is_none()),
        ];
        if let Some((kind, _)) = missing.iter().find(|(_, m)| *m) {
            return Err(RuntimeError::Program(format!(
                "the program declares no {kind} step input"
            )));
        }
        let block_bytes = bytes_of(
            config.kv_cache_dtype,
            info.kv.num_kv_heads as u64 * u64::from(config.block_size) * info.kv.head_dim as u64,
        );
        Ok(PreparedParts {
            max,
            tasks,
            inputs,
            logits,
            kv_blocks: KvBlockLayout::new(kv, block_bytes),
        })
    }

    fn assemble(
        device: Device,
        info: ModelInfo,
        _config: RuntimeConfig,
        parts: PreparedParts,
        owned: Vec<BufferId>,
    ) -> Runtime {
        let limits = StepLimits {
            max: parts.max,
            vocab: info.vocab_size,
        };
        let widest = parts.tasks.iter().map(|t| t.args.len()).max().unwrap_or(0);
        let task_args: Vec<Vec<(BufferId, ArgTag)>> = parts
            .tasks
            .iter()
            .map(|t| t.args.iter().map(|(b, tag)| (b.id, *tag)).collect())
            .collect();
        let graph = TaskGraph::build(task_args.iter().map(Vec::as_slice));
        Runtime {
            device,
            info,
            limits,
            tasks: parts.tasks,
            inputs: parts.inputs,
            logits: parts.logits,
            kv_blocks: parts.kv_blocks,
            owned,
            staging: StepStaging::default(),
            graph,
            mirror: InputMirror::default(),
            write_bytes: Vec::new(),
            launch_args: Vec::with_capacity(widest),
        }
    }

    pub fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    /// The ordering the argument tags impose on the program's tasks.
    pub fn task_graph(&self) -> &TaskGraph {
        &self.graph
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs one step. `logits` receives one row of `vocab_size` values per emitting sequence, in batch order.
    pub fn execute(
        &mut self,
        batch: &[StepSequence<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<StepTiming, RuntimeError> {
        self.execute_scored(batch, &[], logits, || {})
    }

    /// The most logits rows one step returns: the rows of the logits buffer allocated at
    /// prepare time (one per sequence of the largest batch).
    pub fn max_logits_rows(&self) -> u32 {
        self.limits.max.emitting.try_into().unwrap_or(u32::MAX)
    }

    /// Runs one step as [`Runtime::execute`] does; after the emitting rows, `logits` also
    /// receives sequence `i`'s first `scored[i]` rows, in batch order. At most
    /// [`Runtime::max_logits_rows`] rows in all. `while_running` runs once the step's
    /// launches are with the device, before waiting for them: in a worker process, host work
    /// there overlaps the device's (an in-process device has run them by then).
    pub fn execute_scored(
        &mut self,
        batch: &[StepSequence<'_>],
        scored: &[u32],
        logits: &mut Vec<f32>,
        while_running: impl FnOnce(),
    ) -> Result<StepTiming, RuntimeError> {
        let started = Instant::now();
        let extents = self.staging.fill_scored(batch, scored, &self.limits)?;
        let prepare_inputs = started.elapsed();
        let result = self.run_step(extents, logits, while_running);
        match &result {
            Ok(_) => self.mirror.step_done(
                &self.staging,
                &self.staging.slot_ids,
                &self.staging.row_lens,
                self.limits.max.blocks_per_sequence as usize,
            ),
            // The device may hold half-written inputs: write everything next step.
            Err(_) => self.mirror.invalidate(),
        }
        result.map(|timing| StepTiming {
            prepare_inputs,
            ..timing
        })
    }

    fn run_step(
        &mut self,
        extents: Extents,
        logits: &mut Vec<f32>,
        while_running: impl FnOnce(),
    ) -> Result<StepTiming, RuntimeError> {
        let dispatch_started = Instant::now();
        self.write_inputs()?;
        let mut shape = [0u64; 4];
        for task in &self.tasks {
            self.launch_args.clear();
            let mut empty = false;
            for (buffer, tag) in &task.args {
                let elements = extents.resolve_shape(&buffer.shape, &mut shape);
                empty |= elements == 0;
                self.launch_args.push(
                    TensorArg::new(
                        buffer.id.raw(),
                        0,
                        buffer.dtype,
                        &shape[..buffer.shape.len()],
                        *tag,
                    )
                    .map_err(|e| RuntimeError::Program(e.to_string()))?,
                );
            }
            // A task over an empty extent (no emitting rows) has nothing to compute.
            if !empty {
                self.device
                    .launch(task.callable, &self.launch_args, &task.params)?;
            }
        }
        self.device.submit()?;
        while_running();
        let values = extents.emitting as usize * self.info.vocab_size as usize;
        // Read straight into the f32 rows: one copy, not two.
        logits.resize(values, 0.0);
        let (device, read_logits) = if values > 0 {
            // The step's end and its logits in one call: one round trip to a worker process.
            self.device.synchronize_and_read(
                self.logits,
                0,
                bytemuck::cast_slice_mut(logits.as_mut_slice()),
            )?
        } else {
            (self.device.synchronize()?, Duration::ZERO)
        };
        let dispatch = dispatch_started
            .elapsed()
            .saturating_sub(device)
            .saturating_sub(read_logits);
        Ok(StepTiming {
            prepare_inputs: Duration::ZERO,
            dispatch,
            device,
            read_logits,
        })
    }

    /// Writes only what the refresh policies say changed since the last step.
    fn write_inputs(&mut self) -> Result<(), RuntimeError> {
        let s = &self.staging;
        let width = self.limits.max.blocks_per_sequence as usize;
        for write in self.mirror.writes(s, &s.slot_ids, &s.row_lens, width) {
            let (buffer, values) = match write.kind {
                InputKind::TokenIds => (self.inputs.token_ids, &s.token_ids),
                InputKind::QueryStart => (self.inputs.query_start, &s.query_start),
                InputKind::LogitsIndices => (self.inputs.logits_indices, &s.logits_indices),
                InputKind::BlockTable => (self.inputs.block_table, &s.block_table),
                InputKind::SeqLens => (self.inputs.seq_lens, &s.seq_lens),
            };
            let (Some(buffer), Some(values)) = (buffer, values.get(write.range.clone())) else {
                continue;
            };
            if values.is_empty() {
                continue;
            }
            self.write_bytes.clear();
            self.write_bytes
                .extend(values.iter().flat_map(|v| v.to_le_bytes()));
            self.device
                .write(buffer, write.range.start as u64 * 4, &self.write_bytes)?;
        }
        Ok(())
    }

    /// Frees every buffer the runtime allocated and hands the device back.
    pub fn into_device(mut self) -> Result<Device, RuntimeError> {
        // A copy out in flight reads the KV caches, which the device refuses to free until it
        // ended; its bytes are no longer wanted.
        if let Err(e) = self.device.poll_copy_out(true) {
            tracing::warn!("a copy out of the device ended in an error: {e}");
        }
        for id in std::mem::take(&mut self.owned) {
            self.device.free(id)?;
        }
        Ok(self.device)
    }

    /// Frees every buffer and closes the device.
    pub fn close(self) -> Result<(), RuntimeError> {
        self.into_device()?.close();
        Ok(())
    }

    /// How long the device has spent since the last synchronize, for callers timing outside `execute`.
    pub fn synchronize(&mut self) -> Result<Duration, RuntimeError> {
        Ok(self.device.synchronize()?)
    }
}

struct PreparedParts {
    max: Extents,
    tasks: Vec<PreparedTask>,
    inputs: StepInputBuffers,
    logits: BufferId,
    kv_blocks: KvBlockLayout,
}

fn check_rank(name: &str, shape: &[Dim]) -> Result<(), RuntimeError> {
    if shape.is_empty() || shape.len() > 4 {
        return Err(RuntimeError::Program(format!(
            "buffer {name} has rank {}, devices take 1 to 4",
            shape.len()
        )));
    }
    Ok(())
}

struct BufferResolver<'a> {
    named: &'a HashMap<String, Buffer>,
    weights: &'a HashMap<String, Buffer>,
    kv: &'a [(BufferId, BufferId)],
    kv_shape: &'a [Dim],
    kv_dtype: DType,
    logits: Buffer,
}

impl BufferResolver<'_> {
    fn resolve(&self, r: &BufferRef) -> Result<Buffer, String> {
        let kv = |layer: u32, value: bool| {
            let (k, v) = self
                .kv
                .get(layer as usize)
                .ok_or(format!("no KV cache for layer {layer}"))?;
            Ok(Buffer {
                id: if value { *v } else { *k },
                dtype: self.kv_dtype,
                shape: self.kv_shape.to_vec(),
            })
        };
        match r {
            BufferRef::Weight(name) => self
                .weights
                .get(name)
                .cloned()
                .ok_or(format!("weight {name} is not in the model's weight list")),
            BufferRef::Scratch(name) => self
                .named
                .get(&format!("scratch:{name}"))
                .cloned()
                .ok_or(format!("no scratch buffer {name}")),
            BufferRef::Input(name) => self
                .named
                .get(&format!("input:{name}"))
                .cloned()
                .ok_or(format!("no step input {name}")),
            BufferRef::KeyCache(layer) => kv(*layer, false),
            BufferRef::ValueCache(layer) => kv(*layer, true),
            BufferRef::Logits => Ok(self.logits.clone()),
        }
    }
}
