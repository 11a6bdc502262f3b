//! Generates the CRIU RPC types from CRIU's own `images/rpc.proto` (MIT, vendored), and the
//! parts of CRIU's image files hiber reads (`proto/stats.proto`, `proto/files.proto`, in
//! CRIU's wire format).
fn main() {
    println!("cargo:rerun-if-changed=proto/rpc.proto");
    println!("cargo:rerun-if-changed=proto/stats.proto");
    println!("cargo:rerun-if-changed=proto/files.proto");
    prost_build::Config::new()
        .compile_protos(&["proto/rpc.proto", "proto/stats.proto", "proto/files.proto"], &["proto/"])
        .expect("compile proto/*.proto (needs protoc: run scripts/setup.sh)");
}
