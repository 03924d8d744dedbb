//! gRPC bench.
fn main() {}
