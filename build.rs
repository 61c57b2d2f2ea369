//! Generates the FFI layer at build time.
//!
//! bindgen reads rdma-core's own headers; `wrap_static_fns` turns every
//! `static inline` verb (ibv_post_send, ibv_poll_cq, ibv_wr_*, ...) into an
//! exported C wrapper that `cc` compiles, so the inline code that runs is
//! rdma-core's, not a hand port.

use std::env;
use std::path::PathBuf;

const APT_HINT: &str = "install the RDMA development packages: \
     `sudo apt-get install libibverbs-dev librdmacm-dev libclang-dev clang pkg-config` \
     (or run `cargo xtask setup`, which installs everything the project needs)";

fn probe(name: &str) -> pkg_config::Library {
    match pkg_config::Config::new().probe(name) {
        Ok(lib) => lib,
        Err(e) => {
            panic!("\n\nrdma-verbs: pkg-config could not find `{name}` ({e}).\n=> {APT_HINT}\n\n")
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/ffi/wrapper.h");

    let verbs = probe("libibverbs");
    let cma = probe("librdmacm");

    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let shim_c = out.join("static_inline_shim");
    let include_paths: Vec<PathBuf> = verbs
        .include_paths
        .iter()
        .chain(cma.include_paths.iter())
        .cloned()
        .collect();

    let builder = bindgen::Builder::default()
        .header("src/ffi/wrapper.h")
        .clang_args(include_paths.iter().map(|p| format!("-I{}", p.display())))
        .allowlist_function("ibv_.*|_ibv_.*|__ibv_.*|___ibv_.*|rdma_.*|verbs_.*")
        .allowlist_type("ibv_.*|rdma_.*|verbs_.*")
        .allowlist_var("IBV_.*|RDMA_.*|VERBS_.*")
        .blocklist_type("pthread_.*")
        .raw_line("use libc::{pthread_mutex_t, pthread_cond_t};")
        .derive_default(true)
        .derive_debug(true)
        .prepend_enum_name(false)
        .bitfield_enum("ibv_access_flags|ibv_send_flags|ibv_wc_flags|ibv_qp_attr_mask")
        .layout_tests(true)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shim_c)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));

    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => {
            panic!("\n\nrdma-verbs: bindgen failed on the verbs headers ({e}).\n=> {APT_HINT}\n\n")
        }
    };
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs into OUT_DIR");

    // Compile the wrappers bindgen wrote for the static-inline functions.
    let mut cc = cc::Build::new();
    cc.file(shim_c.with_extension("c"))
        .include(env::current_dir().expect("cwd"))
        .includes(&include_paths)
        .warnings(false);
    cc.compile("rdma_verbs_static_inline");
}
