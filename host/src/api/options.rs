//! The `serve` flags of the HTTP layer (keys, browsers, admission, body size, the response store) and the
//! [`ApiConfig`] they make.

use std::net::SocketAddr;

use clap::Args;

use super::ApiConfig;
use super::auth::ApiKeys;
use super::browser::AllowedOrigins;
use super::responses::store::ResponseStoreLimits;
use crate::cli::parse_bytes;
use crate::load_metrics::MetricNames;

#[derive(Debug, Clone, Args)]
pub struct HttpArgs {
    /// Require `Authorization: Bearer KEY` on every route but /health, /ready and /metrics.
    /// Repeat for several keys.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "PLUGHOST_API_KEY",
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// Origins whose web pages may call the API (CORS, preflight included): `*` or a comma list
    /// like `https://app.example,http://localhost:3000`. Default: none, no CORS headers.
    #[arg(long, value_name = "ORIGINS")]
    pub allowed_origins: Option<AllowedOrigins>,
    /// Sequences (one per prompt and choice) in the server at once, waiting or running;
    /// beyond it, 429 with `Retry-After`.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_waiting_requests: u32,
    /// Open the /admin routes (deployment listing, reload) to `Authorization: Bearer KEY`.
    /// Without it they answer 403. API keys never open them.
    #[arg(
        long = "admin-key",
        value_name = "KEY",
        env = "PLUGHOST_ADMIN_KEY",
        hide_env_values = true
    )]
    pub admin_key: Option<String>,
    /// Largest request body, e.g. `16MiB`; larger ones get 413.
    #[arg(long, value_parser = parse_body_size, default_value = "16MiB")]
    pub max_request_body: usize,
    /// Split a reasoning model's thinking into `reasoning_content`: `auto` (when the chat
    /// template writes `<think>`), `qwen3` (`<think>…</think>`, also DeepSeek-R1's) or `none`.
    #[arg(long, value_enum, default_value_t = ReasoningParserChoice::Auto)]
    pub reasoning_parser: ReasoningParserChoice,
    /// `vllm` also exports the load gauges under vLLM's names (`vllm:num_requests_waiting`,
    /// `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`), as
    /// a router's endpoint picker reads them by default.
    #[arg(long, value_enum, default_value_t = MetricNames::Plughost)]
    pub metrics_names: MetricNames,
    /// Seconds a response made with `store: true` stays retrievable (`GET /v1/responses/ID`,
    /// `previous_response_id`). The store is in memory, per process.
    #[arg(long, value_name = "SECONDS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..))]
    pub response_store_ttl: u64,
    /// Most bytes of stored responses, e.g. `64MiB`; the oldest go first beyond it.
    #[arg(long, value_name = "SIZE", value_parser = parse_body_size, default_value = "64MiB")]
    pub response_store_size: usize,
}

/// `--reasoning-parser`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParserChoice {
    #[default]
    Auto,
    Qwen3,
    None,
}

fn parse_body_size(text: &str) -> Result<usize, String> {
    let bytes = parse_bytes(text)?;
    match usize::try_from(bytes) {
        Ok(0) | Err(_) => Err(format!("{text} is not a usable body size")),
        Ok(n) => Ok(n),
    }
}

impl HttpArgs {
    /// The API settings these flags ask for, with the defaults of the rest.
    pub fn api_config(&self) -> Result<ApiConfig, String> {
        let api_keys =
            ApiKeys::new(&self.api_keys).map_err(|e| format!("invalid --api-key: {e}"))?;
        let admin_keys =
            ApiKeys::new(self.admin_key.iter()).map_err(|e| format!("invalid --admin-key: {e}"))?;
        Ok(ApiConfig {
            admin_keys,
            max_body_bytes: self.max_request_body,
            api_keys,
            allowed_origins: self.allowed_origins.clone(),
            max_waiting_requests: self.max_waiting_requests as usize,
            reasoning_parser: self.reasoning_parser,
            response_store: ResponseStoreLimits {
                ttl: std::time::Duration::from_secs(self.response_store_ttl),
                max_bytes: self.response_store_size,
            },
            ..ApiConfig::default()
        })
    }
}

/// Says so when the API is reachable from other machines and anyone there may use it.
pub fn warn_if_open(addr: SocketAddr, config: &ApiConfig) {
    if config.api_keys.is_empty() && !addr.ip().is_loopback() {
        tracing::warn!(
            "listening on {addr} without an API key: anyone who can reach this address can use \
             the API; pass --api-key (or set PLUGHOST_API_KEY), or listen on 127.0.0.1"
        );
    }
}
