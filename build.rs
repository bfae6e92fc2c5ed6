//! With `--features cuda`: compiles the fused ops' CUDA kernels (`src/model/ops/cuda/*.cu`) to
//! PTX with nvcc, one module per file, into OUT_DIR, where `model::ops::cuda` includes them.
//! The driver JIT-compiles the PTX for the GPU it runs on.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH (scripts/install_cuda.sh
//! installs one from PyPI and prints the variables). `$CUDA_COMPUTE_CAP` (default 80) is the
//! virtual architecture the PTX targets: it must not be newer than the GPU's. The default build
//! runs nothing here.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &str = "src/model/ops/cuda";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={KERNELS}");
    let nvcc = std::env::var("NVCC").ok().map(PathBuf::from).unwrap_or_else(|| match std::env::var_os("CUDA_HOME") {
        Some(home) => PathBuf::from(home).join("bin/nvcc"),
        None => PathBuf::from("nvcc"),
    });
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    // What the kernels were built for (flash attention needs 80).
    println!("cargo:rustc-env=OXRL_CUDA_COMPUTE_CAP={cap}");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut sources: Vec<PathBuf> = std::fs::read_dir(KERNELS)
        .expect("the kernels' directory")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    for src in sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(src.with_extension("ptx").file_name().expect("a file name"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}"), "-I", KERNELS, "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {} (set NVCC, or run scripts/install_cuda.sh): {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
}
