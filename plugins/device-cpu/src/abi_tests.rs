//! Tests through the C ABI table, with the device opened as the host opens it: one decoder step that launches every callable, checked against the kernels called directly, the failures that come back as codes and messages, weights kept in the device's own arrangement, and block-quantized weights.

mod arrangement;
mod device;
mod failures;
mod quantized;
mod step;
