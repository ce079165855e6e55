//! Putting a model folder on a device: the glue describes it, the checkpoint is checked, the program is prepared.

use std::borrow::Cow;
use std::cell::Cell;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use crate::device::Device;
use crate::model::{Checkpoint, ModelError, WeightQuantization, quantize};
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

/// A checkpoint whose linear projections (`*_proj.weight`) are quantized to ggml block types
/// as they are uploaded; other tensors, and weights already block-quantized, pass unchanged.
/// One weight's blocks exist at a time.
struct QuantizingSource<'a> {
    inner: &'a dyn WeightSource,
    target: WeightQuantization,
    done: Cell<usize>,
    total: usize,
    /// Drawn only on a terminal; elsewhere (a container's log) progress is a line per tenth.
    bar: Option<ProgressBar>,
}

impl<'a> QuantizingSource<'a> {
    fn new(inner: &'a dyn WeightSource, target: WeightQuantization, info: &ModelInfo) -> Self {
        let total = info
            .weights
            .iter()
            .filter(|w| is_projection(&w.name))
            .count();
        let bar = std::io::stderr().is_terminal().then(|| {
            let style =
                ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} weights {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
            ProgressBar::new(total as u64)
                .with_style(style)
                .with_message(format!("quantizing to {}", target.name()))
        });
        QuantizingSource {
            inner,
            target,
            done: Cell::new(0),
            total,
            bar,
        }
    }

    fn advance(&self) {
        let done = self.done.get() + 1;
        self.done.set(done);
        if let Some(bar) = &self.bar {
            bar.set_position(done as u64);
            if done == self.total {
                bar.finish_and_clear();
            }
        }
        if done == self.total || done.is_multiple_of(self.total.div_ceil(10).max(1)) {
            tracing::info!(
                target = self.target.name(),
                "quantized {done} of {} projection weights",
                self.total
            );
        }
    }
}

impl Drop for QuantizingSource<'_> {
    fn drop(&mut self) {
        // A load that failed midway must not leave a bar on the terminal.
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn is_projection(name: &str) -> bool {
    name.ends_with("_proj.weight")
}

impl WeightSource for QuantizingSource<'_> {
    fn weight(&self, name: &str) -> Result<WeightView<'_>, RuntimeError> {
        let view = self.inner.weight(name)?;
        if !is_projection(name) || view.shape.len() != 2 {
            return Ok(view);
        }
        let row_len = view.shape[1] as usize;
        let Some(dtype) = self.target.dtype_for(row_len) else {
            tracing::warn!(
                weight = name,
                "rows of {row_len} values do not split into blocks of 32: kept in {}",
                view.dtype.name()
            );
            return Ok(view);
        };
        if dtype != self.target.dtype() {
            tracing::warn!(
                weight = name,
                "rows of {row_len} values do not split into blocks of 256: {} instead of {}",
                dtype.name(),
                self.target.name()
            );
        }
        let Some(values) = quantize::widen(view.dtype, &view.bytes) else {
            return Ok(view);
        };
        self.advance();
        Ok(WeightView {
            dtype,
            shape: view.shape,
            bytes: Cow::Owned(quantize::quantize(dtype, &values)),
        })
    }

    fn uploaded(&self, name: &str) {
        self.inner.uploaded(name);
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
    quantize: Option<WeightQuantization>,
}

/// Prepares `program` on `device` with the weights of `checkpoint`, quantized to `quantize`
/// when given; the device is closed when that fails.
fn prepare_checkpoint(
    device: Device,
    info: ModelInfo,
    program: &StepProgram,
    checkpoint: &Checkpoint,
    config: RuntimeConfig,
    quantize: Option<WeightQuantization>,
) -> Result<Runtime, LoadError> {
    let quantizing = quantize.map(|target| QuantizingSource::new(checkpoint, target, &info));
    let weights: &dyn WeightSource = match &quantizing {
        Some(source) => source,
        None => checkpoint,
    };
    Runtime::prepare(device, info, program, weights, config).map_err(|(device, e)| {
        device.close();
        LoadError::Runtime(e)
    })
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
        prepare_checkpoint(
            device,
            self.info.clone(),
            &self.program,
            &checkpoint,
            self.config,
            self.quantize,
        )
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
    load_with_recipe(device, glue, info, model_dir, config, None).map(|(runtime, _)| runtime)
}

/// [`load_described`], with the linear projections quantized to `quantize` when given; also
/// returns the recipe that prepares the same model again.
pub fn load_with_recipe(
    device: Device,
    glue: &mut GluePlugin,
    info: ModelInfo,
    model_dir: &Path,
    config: RuntimeConfig,
    quantize: Option<WeightQuantization>,
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
        quantize,
    };
    let runtime = prepare_checkpoint(device, info, &recipe.program, &checkpoint, config, quantize)?;
    Ok((runtime, recipe))
}
