//! What the CPU device's benchmarks share: their common command-line options, the CPU's name, the timing of a launch (wall time, and the time the calling thread spent on a CPU) and the line naming the read bandwidth.

use std::time::{Duration, Instant};

use plughost_device_cpu::RowPrefetch;

/// The options every benchmark takes: `--portable` (time the portable level too),
/// `--threads N`, `--seconds S` (time per case, at least), `--prefetch
/// auto|on|groups|groups_batched|off` and a filter on the cases' names.
pub struct CommonOptions {
    portable: bool,
    threads: usize,
    seconds: f64,
    prefetch: RowPrefetch,
    filter: Option<String>,
}

impl CommonOptions {
    /// The command line's options; `extra(flag)` takes the benchmark's own flags (without
    /// values) and says whether it knew the flag. A bad value ends the process with status 2.
    pub fn parse(mut extra: impl FnMut(&str) -> bool) -> CommonOptions {
        let mut options = CommonOptions {
            portable: false,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            seconds: 0.5,
            prefetch: RowPrefetch::for_this_cpu(),
            filter: None,
        };
        let number = |value: Option<String>, flag: &str| -> f64 {
            value.and_then(|n| n.parse().ok()).unwrap_or_else(|| {
                eprintln!("{flag} takes a number");
                std::process::exit(2)
            })
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                // What `cargo bench` passes to every harness-less benchmark.
                "--bench" => {}
                "--portable" => options.portable = true,
                "--threads" => options.threads = number(args.next(), "--threads") as usize,
                "--seconds" => options.seconds = number(args.next(), "--seconds"),
                "--prefetch" => {
                    let value = args.next().unwrap_or_default();
                    options.prefetch = value.parse().unwrap_or_else(|error| {
                        eprintln!("--prefetch: {error}");
                        std::process::exit(2)
                    });
                }
                flag if extra(flag) => {}
                other => options.filter = Some(other.to_string()),
            }
        }
        options
    }

    pub fn portable(&self) -> bool {
        self.portable
    }

    pub fn threads(&self) -> usize {
        self.threads.max(1)
    }

    pub fn seconds(&self) -> f64 {
        self.seconds
    }

    /// `--prefetch auto|on|groups|groups_batched|off`, the device's `prefetch=` (by default
    /// what `auto` picks).
    pub fn prefetch(&self) -> RowPrefetch {
        self.prefetch
    }

    /// Whether the case named `name` is to run: there is no filter, or the name holds it.
    pub fn wants(&self, name: &str) -> bool {
        self.filter
            .as_ref()
            .is_none_or(|filter| name.contains(filter.as_str()))
    }
}

/// The CPU's model name, from `/proc/cpuinfo`.
pub fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find_map(|line| line.strip_prefix("model name"))
        .and_then(|rest| rest.split(':').nth(1))
        .map_or_else(|| "unknown CPU".to_string(), |name| name.trim().to_string())
}

/// The calling thread's time on a CPU so far (Linux's schedstat), if the system says.
pub fn thread_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// What one launch takes: the median wall time over at least five launches and `seconds` in
/// all, after one launch that lets buffers grow and the workers wake (`launch(i)` runs the
/// `i`-th), and the mean time the calling thread spent on a CPU per launch, which a shared
/// machine's other load does not inflate (with one thread, all of the launch's work).
pub fn time_launch(seconds: f64, mut launch: impl FnMut(usize)) -> (Duration, Option<Duration>) {
    launch(0);
    let mut times = Vec::new();
    let start = Instant::now();
    let cpu_start = thread_cpu_time();
    while times.len() < 5 || (start.elapsed().as_secs_f64() < seconds && times.len() < 10_000) {
        let run = Instant::now();
        launch(times.len() + 1);
        times.push(run.elapsed());
    }
    let cpu = thread_cpu_time()
        .zip(cpu_start)
        .map(|(end, start)| (end - start) / times.len() as u32);
    times.sort();
    (times[times.len() / 2], cpu)
}

/// Prints the read bandwidth the figures are measured against, the median of `measured`,
/// and the measurements it is the median of; returns the median in GB/s.
pub fn print_bandwidth(measured: &[super::bandwidth::Bandwidth]) -> f64 {
    let bound = super::bandwidth::median(measured)
        .expect("two measurements")
        .gb_per_second();
    let each: Vec<String> = measured
        .iter()
        .map(|b| format!("{:.1}", b.gb_per_second()))
        .collect();
    println!(
        "\nread bandwidth {bound:.1} GB/s (median of {}: {})",
        measured.len(),
        each.join(", ")
    );
    bound
}

/// Prints the steps of `table` (name, median step, weights' GB/s) as a markdown table, each
/// step's GB/s also as a share of `bound`; `what` heads the names' column.
pub fn print_step_table(what: &str, table: &[(String, Duration, f64)], bound: f64) {
    println!("\n| {what} | ms per step | weights GB/s | of bandwidth |\n|---|---:|---:|---:|");
    for (name, median, gb_s) in table {
        println!(
            "| {name} | {:.2} | {gb_s:.1} | {:.0}% |",
            median.as_secs_f64() * 1e3,
            100.0 * gb_s / bound
        );
    }
}

/// The projections of a decode step, in the order [`time_steps`] reports their times.
pub const PARTS: [&str; 5] = ["qkv", "o", "gate/up", "down", "head"];

/// What one decode step takes: the median wall time over at least five steps and `seconds`
/// in all, after one that lets buffers grow, and each projection's mean time and share
/// (`step` adds the time of each of [`PARTS`] to its argument).
pub fn time_steps(seconds: f64, mut step: impl FnMut(&mut [Duration; 5])) -> (Duration, String) {
    step(&mut [Duration::ZERO; 5]);
    let mut times = Vec::new();
    let mut parts = [Duration::ZERO; 5];
    let start = Instant::now();
    while times.len() < 5 || start.elapsed().as_secs_f64() < seconds {
        let run = Instant::now();
        step(&mut parts);
        times.push(run.elapsed());
    }
    let steps = times.len() as u32;
    times.sort();
    let total: Duration = parts.iter().sum();
    let shares: Vec<String> = PARTS
        .iter()
        .zip(parts)
        .map(|(part, time)| {
            format!(
                "{part} {:.2} ms ({:.0}%)",
                (time / steps).as_secs_f64() * 1e3,
                100.0 * time.as_secs_f64() / total.as_secs_f64()
            )
        })
        .collect();
    (times[times.len() / 2], shares.join(", "))
}

/// Two settings' decode steps, alternately: `set(i)` switches to the `i`-th before each step,
/// so both meet the same moments of a shared machine, whose bandwidth can move by half from
/// one minute to the next. Each setting's median step over at least five and `seconds` in all,
/// after one step of each that lets buffers grow.
pub fn time_steps_alternating(
    seconds: f64,
    mut set: impl FnMut(usize),
    mut step: impl FnMut(&mut [Duration; 5]),
) -> [Duration; 2] {
    let mut times = [Vec::new(), Vec::new()];
    for i in 0..2 {
        set(i);
        step(&mut [Duration::ZERO; 5]);
    }
    let start = Instant::now();
    while times[1].len() < 5 || start.elapsed().as_secs_f64() < seconds {
        for (i, times) in times.iter_mut().enumerate() {
            set(i);
            let run = Instant::now();
            step(&mut [Duration::ZERO; 5]);
            times.push(run.elapsed());
        }
    }
    times.map(|mut times| {
        times.sort();
        times[times.len() / 2]
    })
}

/// The dimensions of a decoder's linears, for the benchmarks of a whole decode step.
pub struct Shape {
    pub name: &'static str,
    pub hidden: usize,
    pub query: usize,
    pub key_value: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub vocab: usize,
}

pub const SHAPES: [Shape; 2] = [
    Shape {
        name: "SmolLM2-135M",
        hidden: 576,
        query: 576,
        key_value: 192,
        intermediate: 1536,
        layers: 30,
        vocab: 49_152,
    },
    Shape {
        name: "Qwen3-0.6B",
        hidden: 1024,
        query: 2048,
        key_value: 1024,
        intermediate: 3072,
        layers: 28,
        vocab: 151_936,
    },
];
