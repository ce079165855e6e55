//! A world in every contract version the host speaks: the version a component names picks the bindings it is linked and called through.
//!
//! The engine speaks the newest contract. A component built for an older one is linked
//! against that version's bindings and called through an adapter in its world's module,
//! which passes it the same records without the fields its version does not have; what it
//! returns is read back into the host's own types the same way as a new component's.

use wasmtime::Store;
use wasmtime::component::{InstancePre, Linker};

use super::contract::ContractVersion;
use super::instance::{PluginState, World};

/// The generated bindings of one world in one contract version.
pub(crate) trait WorldBindings: Sized + 'static {
    type Pre: Clone;
    /// The world's name in the WIT, the same in every version.
    const NAME: &'static str;
    fn add_to_linker(linker: &mut Linker<PluginState>) -> wasmtime::Result<()>;
    fn pre(pre: InstancePre<PluginState>) -> wasmtime::Result<Self::Pre>;
    fn instantiate(pre: &Self::Pre, store: &mut Store<PluginState>) -> wasmtime::Result<Self>;
    fn call_init(
        &self,
        store: &mut Store<PluginState>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>>;
}

/// Implements [`WorldBindings`] for a world's generated bindings; every world links,
/// pre-instantiates, instantiates and initialises the same way in every version.
macro_rules! impl_world_bindings {
    ($bindings:ident :: $world:ident, $pre:ident, $name:literal) => {
        impl $crate::plugins::versioned::WorldBindings for $bindings::$world {
            type Pre = $bindings::$pre<$crate::plugins::instance::PluginState>;
            const NAME: &'static str = $name;

            fn add_to_linker(
                linker: &mut wasmtime::component::Linker<$crate::plugins::instance::PluginState>,
            ) -> wasmtime::Result<()> {
                type State = $crate::plugins::instance::PluginState;
                $bindings::$world::add_to_linker::<State, wasmtime::component::HasSelf<State>>(
                    linker,
                    |s| s,
                )
            }
            fn pre(
                pre: wasmtime::component::InstancePre<$crate::plugins::instance::PluginState>,
            ) -> wasmtime::Result<Self::Pre> {
                $bindings::$pre::new(pre)
            }
            fn instantiate(
                pre: &Self::Pre,
                store: &mut wasmtime::Store<$crate::plugins::instance::PluginState>,
            ) -> wasmtime::Result<Self> {
                pre.instantiate(&mut *store)
            }
            fn call_init(
                &self,
                store: &mut wasmtime::Store<$crate::plugins::instance::PluginState>,
                config: &str,
            ) -> wasmtime::Result<Result<(), String>> {
                self.call_init(store, config)
            }
        }
    };
}
pub(crate) use impl_world_bindings;

/// One world's bindings (or pre-instantiated bindings) in the version its component names.
#[derive(Clone)]
pub(crate) enum Versioned<Old, New> {
    /// `plughost:plugin@0.1.x`, run through the world's adapter.
    V0_1(Old),
    /// `plughost:plugin@0.2.x`, the host's own.
    V0_2(New),
}

impl<Old: WorldBindings, New: WorldBindings> World for Versioned<Old, New> {
    type Pre = Versioned<Old::Pre, New::Pre>;
    const NAME: &'static str = New::NAME;

    fn add_to_linker(
        linker: &mut Linker<PluginState>,
        version: ContractVersion,
    ) -> wasmtime::Result<()> {
        match version {
            ContractVersion::V0_1 => Old::add_to_linker(linker),
            ContractVersion::V0_2 => New::add_to_linker(linker),
        }
    }

    fn pre(pre: InstancePre<PluginState>, version: ContractVersion) -> wasmtime::Result<Self::Pre> {
        Ok(match version {
            ContractVersion::V0_1 => Versioned::V0_1(Old::pre(pre)?),
            ContractVersion::V0_2 => Versioned::V0_2(New::pre(pre)?),
        })
    }

    fn instantiate(pre: &Self::Pre, store: &mut Store<PluginState>) -> wasmtime::Result<Self> {
        Ok(match pre {
            Versioned::V0_1(pre) => Versioned::V0_1(Old::instantiate(pre, store)?),
            Versioned::V0_2(pre) => Versioned::V0_2(New::instantiate(pre, store)?),
        })
    }

    fn call_init(
        &self,
        store: &mut Store<PluginState>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            Versioned::V0_1(world) => world.call_init(store, config),
            Versioned::V0_2(world) => world.call_init(store, config),
        }
    }
}
