//! Model-glue plugins: the generated WIT types of the `program` interface and the export glue.
//!
//! Glue describes data, not behaviour, so its authors use the WIT records
//! directly; they are re-exported here under `types`.

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "model-glue",
        pub_export_macro: true,
        export_macro_name: "export_model_glue_world",
        default_bindings_module: "plughost_sdk::model_glue::bindings",
    });
}

/// The records a glue plugin returns (`model-info`, `step-program`, ...).
pub use bindings::plughost::plugin::program as types;

/// Implemented by a model-glue plugin. One value lives per plugin instance.
pub trait ModelGlue: Sized + 'static {
    /// Builds the glue from its JSON config (may be empty).
    fn init(config: &str) -> Result<Self, String>;
    /// Checks `config.json` and lists what the model needs.
    fn describe(&self, config_json: &str) -> Result<types::ModelInfo, String>;
    /// Builds the step program for the model of `config.json`.
    fn build_program(&self, config_json: &str) -> Result<types::StepProgram, String>;
}

/// Exports a [`ModelGlue`] implementation as the component's `model-glue` world.
#[macro_export]
macro_rules! export_model_glue {
    ($ty:ty) => {
        thread_local! {
            static __PLUGHOST_GLUE: $crate::__private::RefCell<Option<$ty>> =
                const { $crate::__private::RefCell::new(None) };
        }

        struct __PlughostGlueExport;

        impl __PlughostGlueExport {
            fn with<R>(f: impl FnOnce(&$ty) -> Result<R, String>) -> Result<R, String> {
                __PLUGHOST_GLUE.with(|cell| match cell.borrow().as_ref() {
                    Some(glue) => f(glue),
                    None => Err("model glue called before init".to_string()),
                })
            }
        }

        impl $crate::model_glue::bindings::Guest for __PlughostGlueExport {
            fn init(config: String) -> Result<(), String> {
                let value = <$ty as $crate::model_glue::ModelGlue>::init(&config)?;
                __PLUGHOST_GLUE.with(|cell| *cell.borrow_mut() = Some(value));
                Ok(())
            }

            fn describe(
                config_json: String,
            ) -> Result<$crate::model_glue::types::ModelInfo, String> {
                Self::with(|g| $crate::model_glue::ModelGlue::describe(g, &config_json))
            }

            fn build_program(
                config_json: String,
            ) -> Result<$crate::model_glue::types::StepProgram, String> {
                Self::with(|g| $crate::model_glue::ModelGlue::build_program(g, &config_json))
            }
        }

        $crate::model_glue::bindings::export_model_glue_world!(__PlughostGlueExport);
    };
}
