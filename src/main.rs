fn main() {
    keep_freed_memory();
    std::process::exit(oxrl::cli::main());
}

/// glibc gives freed memory back to the kernel once the free space at the top of the heap passes
/// a threshold (twice the largest buffer freed so far), so the buffers of every step (a prompt
/// prefill's 4 MB activations, a training step's) came back as fresh pages to fault in and
/// zero, step after step (4 % of a 64-request decode run in perf). Here the heap keeps up to
/// 1 GiB of freed memory and serves buffers up to 32 MiB (glibc's largest setting) from it, as
/// PyTorch's caching allocator does: the resident size stays at its peak between steps.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // Safety: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
