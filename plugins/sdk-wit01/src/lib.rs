//! The SDK's model-glue module bound to `plughost:plugin@0.1.0` (its `wit` folder is `wit/0.1`): what the glue SDK was for 0.1 components.
//!
//! `models/qwen3-wit01` builds the current glue's source against this crate under the SDK's
//! name, which makes it a 0.1 component: the fixture of the host's 0.1 adapter for glue.

#[path = "../../sdk/src/model_glue.rs"]
pub mod model_glue;

#[doc(hidden)]
pub mod __private {
    pub use std::cell::RefCell;
}
