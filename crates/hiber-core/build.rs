//! Generates the CRIU RPC types from CRIU's own `images/rpc.proto` (MIT, vendored).
fn main() {
    println!("cargo:rerun-if-changed=proto/rpc.proto");
    prost_build::Config::new().compile_protos(&["proto/rpc.proto"], &["proto/"]).expect("compile proto/rpc.proto (needs protoc: run scripts/setup.sh)");
}
