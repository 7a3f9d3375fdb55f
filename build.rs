//! Builds the dm ioctl door's preload library (src/control/preload.c) as a
//! shared object in OUT_DIR; `dmkit exec` carries it in the binary
//! (src/control/preload.rs says why it is C). Compiles proto/*.proto (the
//! gRPC services `dmkit lvmd` serves) to Rust in OUT_DIR.

fn main() {
    protos();
    // relative relocations packed (DT_RELR, glibc 2.36): the ~37,000 of a
    // position-independent dmkit otherwise take ~900 KiB of table that every
    // process start reads, a quarter of a small tool's peak memory
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    let src = "src/control/preload.c";
    println!("cargo:rerun-if-changed={src}");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let lib = out.join("libdmkit-door.so");
    // the cc crate finds the C compiler and its flags for the target; the
    // shared object is linked by that compiler
    let compiler = cc::Build::new().opt_level(2).pic(true).get_compiler();
    let mut cmd = compiler.to_command();
    cmd.args(["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&lib)
        .arg(src)
        .args(["-ldl", "-lpthread"]);
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running the C compiler for {src}: {e}"));
    assert!(status.success(), "building {src} failed ({status})");
}

/// TopoLVM's lvmd services and CSI's SnapshotMetadata: servers only (the tests'
/// client is generated separately, from the same files, by grpcio-tools).
fn protos() {
    let files = ["proto/lvmd.proto", "proto/csi_snapshot_metadata.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"]).unwrap_or_else(|e| panic!("compiling proto/: {e}"));
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("generating the gRPC code of proto/: {e}"));
}
