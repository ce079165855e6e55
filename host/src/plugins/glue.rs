//! The model-glue world on the host side: called at prepare time to describe a model and build its step program.
//!
//! The program interface has the same shape in 0.1 and 0.2: each version's module generates
//! its bindings and reads their records into the runtime's own types with one definition.

use std::path::Path;

use super::instance::{ContainedInstance, PluginState};
use super::versioned::{Versioned, impl_world_bindings};
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};
use crate::runtime::program::{ModelInfo, StepProgram};

/// One version's model-glue bindings, generated from the WIT in folder `$wit`, and the
/// records glue returns, read into the runtime's types at this boundary.
macro_rules! glue_version {
    ($wit:tt) => {
        mod bindings {
            wasmtime::component::bindgen!({
                path: $wit,
                world: "model-glue",
            });
        }
        pub(super) use bindings::ModelGlue;
        use bindings::plughost::plugin::program as types;

        use super::{PluginState, impl_world_bindings};
        use crate::runtime::program::{
            ArgTag, BufferRef, Dim, Dtype, Extent, KvLayout, ModelInfo, Param, RefreshPolicy,
            Scratch, StepInput, StepInputKind, StepProgram, Task, TensorArg, WeightSpec,
        };

        impl_world_bindings!(bindings::ModelGlue, ModelGluePre, "model-glue");
        impl types::Host for PluginState {}

        pub(super) fn describe(
            world: &ModelGlue,
            store: &mut wasmtime::Store<PluginState>,
            config_json: &str,
        ) -> wasmtime::Result<Result<ModelInfo, String>> {
            Ok(world.call_describe(store, config_json)?.map(model_info))
        }

        pub(super) fn build_program(
            world: &ModelGlue,
            store: &mut wasmtime::Store<PluginState>,
            config_json: &str,
        ) -> wasmtime::Result<Result<StepProgram, String>> {
            Ok(world
                .call_build_program(store, config_json)?
                .map(step_program))
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
                            types::RefreshPolicy::DeviceMaintained => {
                                RefreshPolicy::DeviceMaintained
                            }
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
    };
}

/// `plughost:plugin@0.1`: the same records as 0.2.
mod v0_1 {
    glue_version!("../wit/0.1");
}

/// `plughost:plugin@0.2`, the host's own.
mod v0_2 {
    glue_version!("../wit/0.2");
}

type Bindings = Versioned<v0_1::ModelGlue, v0_2::ModelGlue>;

/// A loaded model-glue plugin.
pub struct GluePlugin {
    instance: ContainedInstance<Bindings>,
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
        let result = self.instance.call(|world, store| match world {
            Versioned::V0_1(world) => v0_1::describe(world, store, config_json),
            Versioned::V0_2(world) => v0_2::describe(world, store, config_json),
        })?;
        self.plugin_result(result)
    }

    /// Builds the step program of the model.
    pub fn build_program(&mut self, config_json: &str) -> Result<StepProgram, PluginError> {
        let result = self.instance.call(|world, store| match world {
            Versioned::V0_1(world) => v0_1::build_program(world, store, config_json),
            Versioned::V0_2(world) => v0_2::build_program(world, store, config_json),
        })?;
        self.plugin_result(result)
    }
}
