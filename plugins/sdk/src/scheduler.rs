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

/// Builds a plan that stays within a step's limits: the token budget, the running slots and the
/// free KV blocks. A policy decides the order; the builder keeps the arithmetic the host checks.
///
/// ```
/// use plughost_sdk::scheduler::{Phase, PlanBuilder, RequestView, Resources};
///
/// let waiting = RequestView {
///     id: 7, phase: Phase::Waiting, priority: 0, arrival_us: 0, prompt_len: 40,
///     computed_len: 0, cached_prefix_len: 0, output_len: 0, max_output: 16, blocks_held: 0,
/// };
/// let resources = Resources {
///     token_budget: 32, max_running: 4, block_size: 16, free_blocks: 8, total_blocks: 8,
/// };
/// let mut plan = PlanBuilder::new(&[waiting.clone()], &resources);
/// assert_eq!(plan.run(&waiting, u32::MAX), 32); // a prefill chunk as large as the budget
/// assert_eq!(plan.finish().run[0].num_tokens, 32);
/// ```
#[derive(Debug, Clone)]
pub struct PlanBuilder {
    plan: Plan,
    tokens_left: u32,
    free_blocks: u64,
    block_size: u32,
    slots_left: u32,
}

impl PlanBuilder {
    /// An empty plan for `requests` under `resources`.
    pub fn new(requests: &[RequestView], resources: &Resources) -> PlanBuilder {
        let running = requests
            .iter()
            .filter(|r| r.phase == Phase::Running)
            .count();
        let running = u32::try_from(running).unwrap_or(u32::MAX);
        PlanBuilder {
            plan: Plan::default(),
            tokens_left: resources.token_budget,
            free_blocks: u64::from(resources.free_blocks),
            block_size: resources.block_size.max(1),
            slots_left: resources.max_running.saturating_sub(running),
        }
    }

    /// Schedules up to `max_tokens` of the request's pending tokens, as many as the budget, the
    /// running slots and the free KV blocks allow. Returns the tokens granted; 0 means the
    /// request does not run this step (nothing pending, no room, already planned or preempted).
    pub fn run(&mut self, request: &RequestView, max_tokens: u32) -> u32 {
        if self.is_planned(request.id) || self.plan.preempt.contains(&request.id) {
            return 0;
        }
        let starts_running = request.phase != Phase::Running;
        if starts_running && self.slots_left == 0 {
            return 0;
        }
        let mut tokens = max_tokens.min(request.pending_len()).min(self.tokens_left);
        // The most tokens the blocks it holds plus the free ones can take.
        let capacity =
            (u64::from(request.blocks_held) + self.free_blocks) * u64::from(self.block_size);
        let room = capacity.saturating_sub(u64::from(request.computed_len));
        tokens = tokens.min(u32::try_from(room).unwrap_or(u32::MAX));
        if tokens == 0 {
            return 0;
        }
        let blocks_after = (u64::from(request.computed_len) + u64::from(tokens))
            .div_ceil(u64::from(self.block_size));
        self.free_blocks -= blocks_after.saturating_sub(u64::from(request.blocks_held));
        self.tokens_left -= tokens;
        if starts_running {
            self.slots_left -= 1;
        }
        self.plan.run.push(Scheduled {
            id: request.id,
            num_tokens: tokens,
        });
        tokens
    }

    /// Preempts a running request that is not planned to run: its KV blocks and its running
    /// slot become free for the requests planned after it. Returns whether it was preempted.
    pub fn preempt(&mut self, request: &RequestView) -> bool {
        if request.phase != Phase::Running
            || self.is_planned(request.id)
            || self.plan.preempt.contains(&request.id)
        {
            return false;
        }
        self.free_blocks += u64::from(request.blocks_held);
        self.slots_left += 1;
        self.plan.preempt.push(request.id);
        true
    }

    /// Whether the request is already in the plan's run list.
    pub fn is_planned(&self, id: RequestId) -> bool {
        self.plan.run.iter().any(|s| s.id == id)
    }

    /// Tokens of the step's budget not yet planned.
    pub fn tokens_left(&self) -> u32 {
        self.tokens_left
    }

    /// KV blocks not yet claimed by the plan.
    pub fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    /// The finished plan.
    pub fn finish(self) -> Plan {
        self.plan
    }
}

/// Implemented by a scheduler plugin. One value lives per plugin instance.
pub trait Scheduler: Sized + 'static {
    /// Builds the scheduler from its JSON config (may be empty).
    fn init(config: &str) -> Result<Self, String>;
    /// Decides engine step `step`. Steps count from 1 and only go up while the engine lives,
    /// whatever happens to this instance (a deployment's dry run, before it serves, is step 0):
    /// it is the clock a policy reads (steps waited), the same on any machine. Running
    /// requests come first, then the others in arrival order.
    fn schedule(&mut self, step: u64, requests: &[RequestView], resources: &Resources) -> Plan;
}

#[cfg(feature = "scheduler")]
#[doc(hidden)]
// The generated export takes `schedule`'s arguments flattened: the step, the list's pointer and
// length, and each field of `resources`.
#[allow(clippy::too_many_arguments)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "scheduler",
        pub_export_macro: true,
        export_macro_name: "export_scheduler_world",
        default_bindings_module: "plughost_sdk::scheduler::bindings",
    });
}

/// The conversions between one contract version's generated scheduling records (`wit` where
/// it is expanded) and the SDK's types: `request_view`, `resources` and `plan`. The SDK expands
/// it over its own bindings; a component bound to another version can expand it over its own.
#[doc(hidden)]
#[macro_export]
macro_rules! __scheduling_adapter {
    () => {
        use $crate::scheduler::{Phase, Plan, RequestView, Resources};

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
    };
}

#[cfg(feature = "scheduler")]
#[doc(hidden)]
pub mod adapter {
    use super::bindings::plughost::plugin::scheduling as wit;

    crate::__scheduling_adapter!();
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
                step: u64,
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
                    Some(s) => {
                        $crate::scheduler::Scheduler::schedule(s, step, &requests, &resources)
                    }
                    None => $crate::scheduler::Plan::default(),
                });
                $crate::scheduler::adapter::plan(plan)
            }
        }

        $crate::scheduler::bindings::export_scheduler_world!(__PlughostSchedulerExport);
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: RequestId, phase: Phase, prompt: u32, computed: u32, held: u32) -> RequestView {
        RequestView {
            id,
            phase,
            priority: 0,
            arrival_us: id,
            prompt_len: prompt,
            computed_len: computed,
            cached_prefix_len: 0,
            output_len: if phase == Phase::Running { 1 } else { 0 },
            max_output: 16,
            blocks_held: held,
        }
    }

    fn resources(token_budget: u32, max_running: u32, free_blocks: u32) -> Resources {
        Resources {
            token_budget,
            max_running,
            block_size: 4,
            free_blocks,
            total_blocks: 64,
        }
    }

    #[test]
    fn the_budget_blocks_and_slots_bound_what_runs() {
        // Running: 8 prompt + 1 output, 8 computed, 2 blocks held; its decode needs a new block.
        let running = view(1, Phase::Running, 8, 8, 2);
        let long = view(2, Phase::Waiting, 30, 0, 0);
        let short = view(3, Phase::Waiting, 3, 0, 0);
        let all = [running.clone(), long.clone(), short.clone()];

        let mut plan = PlanBuilder::new(&all, &resources(16, 2, 4));
        assert_eq!(plan.run(&running, 1), 1);
        assert_eq!(plan.run(&running, 1), 0, "a request is planned once");
        // 3 blocks left hold 12 tokens; the budget has 15.
        assert_eq!(plan.run(&long, u32::MAX), 12);
        assert_eq!(plan.free_blocks(), 0);
        assert_eq!(plan.run(&short, u32::MAX), 0, "no running slot left");
        let plan = plan.finish();
        assert_eq!(plan.run.len(), 2);
        assert!(plan.preempt.is_empty());
    }

    #[test]
    fn preempting_frees_blocks_and_a_slot() {
        let running = view(1, Phase::Running, 8, 8, 2);
        let waiting = view(2, Phase::Waiting, 8, 0, 0);
        let all = [running.clone(), waiting.clone()];
        let mut plan = PlanBuilder::new(&all, &resources(64, 1, 0));
        assert_eq!(plan.run(&waiting, u32::MAX), 0);
        assert!(plan.preempt(&running));
        assert!(!plan.preempt(&running), "preempted once");
        assert!(
            !plan.preempt(&waiting),
            "only running requests are preempted"
        );
        assert_eq!(plan.run(&waiting, u32::MAX), 8);
        assert_eq!(
            plan.run(&running, 1),
            0,
            "a request this plan preempts does not run"
        );
        let plan = plan.finish();
        assert_eq!(plan.preempt, [1]);
        assert_eq!(
            plan.run,
            [Scheduled {
                id: 2,
                num_tokens: 8
            }]
        );
    }
}
