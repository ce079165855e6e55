//! `plughost serve` under stress, over real sockets on the mock device: connections and
//! shutdown, engine and device faults, the HTTP layer's guards, malformed requests, memory, and
//! request ids in the logs.

#[path = "../serve_support/mod.rs"]
mod serve_support;

mod reliability_connections;
mod reliability_device_worker;
mod reliability_engine;
mod reliability_http;
mod reliability_malformed_requests;
mod reliability_memory;
mod reliability_request_ids;
