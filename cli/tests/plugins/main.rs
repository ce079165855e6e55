//! Plugins in a serving `plughost`: failure policies, hot deployments and reloads, the plugin
//! kit and hot-loading an author's sampler, and replicas behind a round-robin client.

#[path = "../serve_support/mod.rs"]
mod serve_support;

mod fleet_replicas;
mod plugin_failure;
mod plugin_hot_load;
mod plugin_kit;
mod plugin_reload;
