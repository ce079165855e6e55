//! The model-glue world on the host side: called at prepare time to describe a model and build its step program.

use std::path::Path;

use super::instance::{ContainedInstance, PluginState};
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.1",
        world: "model-glue",
    });
}

use crate::runtime::program::{
    ArgTag, BufferRef, Dim, Dtype, Extent, KvLayout, ModelInfo, Param, RefreshPolicy, Scratch,
    StepInput, StepInputKind, StepProgram, Task, TensorArg, WeightSpec,
};

/// The records glue returns, as generated from the WIT; converted to the runtime's own types
/// at this boundary.
use bindings::plughost::plugin::program as types;

super::instance::impl_world!(bindings::ModelGlue, ModelGluePre, "model-glue");

impl types::Host for PluginState {}

/// A loaded model-glue plugin.
pub struct GluePlugin {
    instance: ContainedInstance<bindings::ModelGlue>,
}

impl GluePlugin {
    pub fn load(
        runtime: &PluginRuntime,
        path: &Path,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<Self, PluginError> {
        Ok(GluePlugin {
            instance: runtime.instantiate(path, config, limits)?,
        })
    }

    pub fn stats(&self) -> PluginStats {
        self.instance.stats()
    }

    fn plugin_result<T>(&self, result: Result<T, String>) -> Result<T, PluginError> {
        result.map_err(|message| PluginError::Plugin {
            plugin: self.instance.name().to_string(),
            message,
        })
    }

    /// Checks `config.json` and lists the weights and KV layout the model needs.
    pub fn describe(&mut self, config_json: &str) -> Result<ModelInfo, PluginError> {
        let result = self
            .instance
            .call(|world, store| world.call_describe(store, config_json))?;
        self.plugin_result(result).map(model_info)
    }

    /// Builds the step program of the model.
    pub fn build_program(&mut self, config_json: &str) -> Result<StepProgram, PluginError> {
        let result = self
            .instance
            .call(|world, store| world.call_build_program(store, config_json))?;
        self.plugin_result(result).map(step_program)
    }
}

fn model_info(info: types::ModelInfo) -> ModelInfo {
    ModelInfo {
        architecture: info.architecture,
        vocab_size: info.vocab_size,
        max_position: info.max_position,
        eos_token_ids: info.eos_token_ids,
        kv: KvLayout {
            num_layers: info.kv.num_layers,
            num_kv_heads: info.kv.num_kv_heads,
            head_dim: info.kv.head_dim,
        },
        weights: info
            .weights
            .into_iter()
            .map(|w| WeightSpec {
                name: w.name,
                shape: w.shape,
            })
            .collect(),
    }
}

fn step_program(program: types::StepProgram) -> StepProgram {
    StepProgram {
        inputs: program
            .inputs
            .into_iter()
            .map(|i| StepInput {
                name: i.name,
                kind: match i.kind {
                    types::StepInputKind::TokenIds => StepInputKind::TokenIds,
                    types::StepInputKind::Positions => StepInputKind::Positions,
                    types::StepInputKind::SeqLens => StepInputKind::SeqLens,
                    types::StepInputKind::QueryStart => StepInputKind::QueryStart,
                    types::StepInputKind::BlockTable => StepInputKind::BlockTable,
                    types::StepInputKind::SlotMapping => StepInputKind::SlotMapping,
                    types::StepInputKind::LogitsIndices => StepInputKind::LogitsIndices,
                },
                dtype: dtype(i.dtype),
                shape: shape(i.shape),
                policy: match i.policy {
                    types::RefreshPolicy::EveryStep => RefreshPolicy::EveryStep,
                    types::RefreshPolicy::OnChange => RefreshPolicy::OnChange,
                    types::RefreshPolicy::DeviceMaintained => RefreshPolicy::DeviceMaintained,
                },
            })
            .collect(),
        scratch: program
            .scratch
            .into_iter()
            .map(|s| Scratch {
                name: s.name,
                dtype: dtype(s.dtype),
                shape: shape(s.shape),
            })
            .collect(),
        tasks: program.tasks.into_iter().map(task).collect(),
    }
}

fn task(task: types::Task) -> Task {
    Task {
        callable: task.callable,
        args: task
            .args
            .into_iter()
            .map(|a| TensorArg {
                buffer: match a.buffer {
                    types::BufferRef::Weight(name) => BufferRef::Weight(name),
                    types::BufferRef::Scratch(name) => BufferRef::Scratch(name),
                    types::BufferRef::Input(name) => BufferRef::Input(name),
                    types::BufferRef::KeyCache(layer) => BufferRef::KeyCache(layer),
                    types::BufferRef::ValueCache(layer) => BufferRef::ValueCache(layer),
                    types::BufferRef::Logits => BufferRef::Logits,
                },
                tag: match a.tag {
                    types::ArgTag::Input => ArgTag::Input,
                    types::ArgTag::Output => ArgTag::Output,
                    types::ArgTag::Inout => ArgTag::Inout,
                    types::ArgTag::OutputExisting => ArgTag::OutputExisting,
                    types::ArgTag::NoDep => ArgTag::NoDep,
                },
            })
            .collect(),
        params: task
            .params
            .into_iter()
            .map(|p| match p {
                types::Param::Int(v) => Param::Int(v),
                types::Param::Float(f) => Param::Float(f),
                types::Param::BlockSize => Param::BlockSize,
            })
            .collect(),
    }
}

fn dtype(d: types::Dtype) -> Dtype {
    match d {
        types::Dtype::F32 => Dtype::F32,
        types::Dtype::F16 => Dtype::F16,
        types::Dtype::Bf16 => Dtype::Bf16,
        types::Dtype::I32 => Dtype::I32,
        types::Dtype::I64 => Dtype::I64,
        types::Dtype::U8 => Dtype::U8,
    }
}

fn shape(dims: Vec<types::Dim>) -> Vec<Dim> {
    dims.into_iter()
        .map(|d| Dim {
            extent: match d.extent {
                types::Extent::One => Extent::One,
                types::Extent::Tokens => Extent::Tokens,
                types::Extent::Sequences => Extent::Sequences,
                types::Extent::Emitting => Extent::Emitting,
                types::Extent::KvBlocks => Extent::KvBlocks,
                types::Extent::BlockSize => Extent::BlockSize,
                types::Extent::BlocksPerSequence => Extent::BlocksPerSequence,
            },
            factor: d.factor,
            offset: d.offset,
        })
        .collect()
}
