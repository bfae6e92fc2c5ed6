//! The CUDA kernels of the fused ops (src/model/ops/cuda/*.cu), run on the CPU: every build
//! checks their logic, with or without a GPU. tests/cuda_emulation/emulate.h runs a kernel's
//! threads as fibers that meet at __syncthreads and warp shuffles; main.cpp compares every
//! kernel (f32, bf16, f16; blocks of one warp, 128 and 256 threads) with double-precision
//! formulas, and every backward with finite differences. What this cannot see (the launches'
//! arguments from Rust, the real hardware) tests/gpu.rs checks on a GPU.

use std::process::Command;

#[test]
fn cuda_kernels_match_the_formulas_under_emulation() {
    let root = env!("CARGO_MANIFEST_DIR");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let exe = std::env::temp_dir().join(format!("oxrl-cuda-emulation-{}-{nanos}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-include", "tests/cuda_emulation/emulate.h", "-o"])
        .arg(&exe)
        .arg("tests/cuda_emulation/main.cpp")
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler {cxx} (set CXX, or install g++): {e}"));
    assert!(built.status.success(), "compiling the emulation:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&exe).output().expect("running the emulation");
    let _ = std::fs::remove_file(&exe);
    let stdout = String::from_utf8_lossy(&run.stdout);
    print!("{stdout}");
    assert!(run.status.success(), "emulated CUDA kernels failed:\n{stdout}{}", String::from_utf8_lossy(&run.stderr));
    // The summary line: every check ran (a main.cpp that checked nothing must not pass).
    let summary = stdout.lines().last().unwrap_or_default();
    let counts: Vec<usize> = summary.split(|c: char| !c.is_ascii_digit()).filter_map(|s| s.parse().ok()).collect();
    assert!(
        summary.starts_with("emulated kernel checks:") && counts.len() == 2 && counts[0] >= 100 && counts[1] == 0,
        "summary: {summary}"
    );
}
