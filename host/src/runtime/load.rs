//! Putting a model folder on a device: the glue describes it, the checkpoint is checked, the program is prepared.

use std::path::{Path, PathBuf};

use crate::device::Device;
use crate::model::{Checkpoint, ModelError};
use crate::plugins::PluginError;
use crate::plugins::glue::GluePlugin;

use super::program::{ModelInfo, StepProgram};
use super::{Runtime, RuntimeConfig, RuntimeError, WeightSource, WeightView};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl WeightSource for Checkpoint {
    fn weight(&self, name: &str) -> Result<WeightView<'_>, RuntimeError> {
        let view = self
            .tensor(name)
            .map_err(|e| RuntimeError::Weight(e.to_string()))?;
        Ok(WeightView {
            dtype: view.dtype().device_dtype(),
            shape: view.shape().to_vec(),
            bytes: view.data_in_hf_order(),
        })
    }

    fn uploaded(&self, name: &str) {
        self.release_pages(name);
    }
}

/// Opens `model_dir`, asks `glue` for the model's description and program, and prepares them
/// on `device`. The device is closed when loading fails.
pub fn load_model(
    device: Device,
    glue: &mut GluePlugin,
    model_dir: &Path,
    config: RuntimeConfig,
) -> Result<Runtime, LoadError> {
    let info = Checkpoint::open(model_dir)
        .map_err(LoadError::from)
        .and_then(|checkpoint| Ok(glue.describe(checkpoint.config_json())?));
    match info {
        Ok(info) => load_described(device, glue, info, model_dir, config),
        Err(e) => {
            device.close();
            Err(e)
        }
    }
}

/// What it takes to put a model on a device again without its glue: after a device worker
/// was lost, a new one prepares the same program with the same weights.
#[derive(Clone, Debug)]
pub struct ModelRecipe {
    info: ModelInfo,
    program: StepProgram,
    model_dir: PathBuf,
    config: RuntimeConfig,
}

impl ModelRecipe {
    /// Prepares the model on `device`, which is closed when that fails.
    pub fn prepare(&self, device: Device) -> Result<Runtime, LoadError> {
        let checkpoint = match Checkpoint::open(&self.model_dir) {
            Ok(checkpoint) => checkpoint,
            Err(e) => {
                device.close();
                return Err(e.into());
            }
        };
        Runtime::prepare(
            device,
            self.info.clone(),
            &self.program,
            &checkpoint,
            self.config,
        )
        .map_err(|(device, e)| {
            device.close();
            LoadError::Runtime(e)
        })
    }
}

/// [`load_model`] for a caller that already has the glue's description of the model (from
/// the same `config.json`), so `describe` runs once per load.
pub fn load_described(
    device: Device,
    glue: &mut GluePlugin,
    info: ModelInfo,
    model_dir: &Path,
    config: RuntimeConfig,
) -> Result<Runtime, LoadError> {
    load_with_recipe(device, glue, info, model_dir, config).map(|(runtime, _)| runtime)
}

/// [`load_described`], also returning the recipe that prepares the same model again.
pub fn load_with_recipe(
    device: Device,
    glue: &mut GluePlugin,
    info: ModelInfo,
    model_dir: &Path,
    config: RuntimeConfig,
) -> Result<(Runtime, ModelRecipe), LoadError> {
    let prepared = (|| {
        let checkpoint = Checkpoint::open(model_dir)?;
        let expected: Vec<(String, Vec<u64>)> = info
            .weights
            .iter()
            .map(|w| (w.name.clone(), w.shape.clone()))
            .collect();
        checkpoint.check(&expected)?;
        let program = glue.build_program(checkpoint.config_json())?;
        Ok::<_, LoadError>((checkpoint, info, program))
    })();
    let (checkpoint, info, program) = match prepared {
        Ok(parts) => parts,
        Err(e) => {
            device.close();
            return Err(e);
        }
    };
    let recipe = ModelRecipe {
        info: info.clone(),
        program,
        model_dir: model_dir.to_path_buf(),
        config,
    };
    let runtime = Runtime::prepare(device, info, &recipe.program, &checkpoint, config).map_err(
        |(device, e)| {
            device.close();
            LoadError::Runtime(e)
        },
    )?;
    Ok((runtime, recipe))
}
