//! Generates the `bank.v1` service and messages from `proto/bank.proto`, with protox as the
//! protobuf compiler (no `protoc` to install).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/bank.proto");
    let files = protox::compile(["proto/bank.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(files)?;
    Ok(())
}
