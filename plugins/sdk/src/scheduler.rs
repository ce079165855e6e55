//! Scheduler plugins: the per-step view of requests, the plan, and the export glue.

/// A request's identity, stable for its whole life.
pub type RequestId = u64;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Admitted, holds no KV blocks yet.
    Waiting,
    /// Holds KV blocks and ran in an earlier step.
    Running,
    /// Lost its KV blocks and must recompute them.
    Preempted,
}

/// One request as the scheduler sees it. Lengths count tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestView {
    pub id: RequestId,
    pub phase: Phase,
    pub priority: i32,
    pub arrival_us: u64,
    pub prompt_len: u32,
    pub computed_len: u32,
    pub cached_prefix_len: u32,
    pub output_len: u32,
    pub max_output: u32,
    pub blocks_held: u32,
}

impl RequestView {
    /// Tokens whose KV entries exist or will exist once computed: prompt plus output.
    pub fn total_len(&self) -> u32 {
        // Saturating: a view is host input, and a plugin must not trap on it.
        self.prompt_len.saturating_add(self.output_len)
    }

    /// Tokens still to compute before the request can emit its next token.
    pub fn pending_len(&self) -> u32 {
        self.total_len().saturating_sub(self.computed_len)
    }
}

/// What one step may use; the host enforces every limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    pub token_budget: u32,
    pub max_running: u32,
    pub block_size: u32,
    pub free_blocks: u32,
    pub total_blocks: u32,
}

/// One request to run this step and how many tokens it computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: RequestId,
    pub num_tokens: u32,
}

/// The decision for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub run: Vec<Scheduled>,
    pub preempt: Vec<RequestId>,
}

/// Implemented by a scheduler plugin. One value lives per plugin instance.
pub trait Scheduler: Sized + 'static {
    /// Builds the scheduler from its JSON config (may be empty).
    fn init(config: &str) -> Result<Self, String>;
    /// Decides one step. Running requests come first, then the others in arrival order.
    fn schedule(&mut self, requests: &[RequestView], resources: &Resources) -> Plan;
}

#[cfg(feature = "scheduler")]
#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "scheduler",
        pub_export_macro: true,
        export_macro_name: "export_scheduler_world",
        default_bindings_module: "plughost_sdk::scheduler::bindings",
    });
}

#[cfg(feature = "scheduler")]
#[doc(hidden)]
pub mod adapter {
    use super::bindings::plughost::plugin::scheduling as wit;
    use super::*;

    fn phase(phase: wit::Phase) -> Phase {
        match phase {
            wit::Phase::Waiting => Phase::Waiting,
            wit::Phase::Running => Phase::Running,
            wit::Phase::Preempted => Phase::Preempted,
        }
    }

    pub fn request_view(v: wit::RequestView) -> RequestView {
        RequestView {
            id: v.id,
            phase: phase(v.phase),
            priority: v.priority,
            arrival_us: v.arrival_us,
            prompt_len: v.prompt_len,
            computed_len: v.computed_len,
            cached_prefix_len: v.cached_prefix_len,
            output_len: v.output_len,
            max_output: v.max_output,
            blocks_held: v.blocks_held,
        }
    }

    pub fn resources(r: wit::Resources) -> Resources {
        Resources {
            token_budget: r.token_budget,
            max_running: r.max_running,
            block_size: r.block_size,
            free_blocks: r.free_blocks,
            total_blocks: r.total_blocks,
        }
    }

    pub fn plan(p: Plan) -> wit::Plan {
        wit::Plan {
            run: p
                .run
                .into_iter()
                .map(|s| wit::Scheduled {
                    id: s.id,
                    num_tokens: s.num_tokens,
                })
                .collect(),
            preempt: p.preempt,
        }
    }
}

/// Exports a [`Scheduler`] implementation as the component's `scheduler` world.
///
/// A call before a successful `init` returns an empty plan: the host always
/// calls `init` first, so this only guards against a misbehaving host.
#[cfg(feature = "scheduler")]
#[macro_export]
macro_rules! export_scheduler {
    ($ty:ty) => {
        thread_local! {
            static __PLUGHOST_SCHEDULER: $crate::__private::RefCell<Option<$ty>> =
                const { $crate::__private::RefCell::new(None) };
        }

        struct __PlughostSchedulerExport;

        impl $crate::scheduler::bindings::Guest for __PlughostSchedulerExport {
            fn init(config: String) -> Result<(), String> {
                let value = <$ty as $crate::scheduler::Scheduler>::init(&config)?;
                __PLUGHOST_SCHEDULER.with(|cell| *cell.borrow_mut() = Some(value));
                Ok(())
            }

            fn schedule(
                requests: Vec<
                    $crate::scheduler::bindings::plughost::plugin::scheduling::RequestView,
                >,
                resources: $crate::scheduler::bindings::plughost::plugin::scheduling::Resources,
            ) -> $crate::scheduler::bindings::plughost::plugin::scheduling::Plan {
                let requests: Vec<_> = requests
                    .into_iter()
                    .map($crate::scheduler::adapter::request_view)
                    .collect();
                let resources = $crate::scheduler::adapter::resources(resources);
                let plan = __PLUGHOST_SCHEDULER.with(|cell| match cell.borrow_mut().as_mut() {
                    Some(s) => $crate::scheduler::Scheduler::schedule(s, &requests, &resources),
                    None => $crate::scheduler::Plan::default(),
                });
                $crate::scheduler::adapter::plan(plan)
            }
        }

        $crate::scheduler::bindings::export_scheduler_world!(__PlughostSchedulerExport);
    };
}
