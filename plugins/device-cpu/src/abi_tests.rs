//! Tests through the C ABI table, with the device opened as the host opens it: one decoder step that launches every callable, checked against the kernels called directly, the failures that come back as codes and messages, and weights kept in the device's own arrangement.

mod arrangement;
mod device;
mod failures;
mod step;
