//! The `oxrl` command line (cli::main), with mimalloc as the allocator.
//!
//! Why mimalloc: glibc gave freed memory back to the kernel between steps — past its trim
//! threshold on the main heap, and on worker, engine and rayon threads (where all tensor work runs)
//! whenever one of their 64 MiB arena heaps emptied, at the end of every step, whatever the
//! threshold — so each step's buffers were page-faulted in and zeroed again (8,900 faults, 36 MB,
//! a training step even with glibc tuned by `mallopt`). Forcing glibc to one arena removed the
//! faults but made the RL demo 15 % slower (its threads contending for one lock). mimalloc keeps
//! memory per thread: same-run A/B against glibc with `mallopt` (BENCHMARKS.md): decoding +3 to
//! +5 %, the training step at one thread about 4 % faster, the RL demo 4 % faster.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(oxrl::cli::main());
}
