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
    // candle's elementwise ops on 64 Ki elements and more run on a process-wide pool of its own
    // (one thread per physical core less one, spinning between ops), outside every actor's thread
    // budget: under `--threads 1` it put a second, spinning thread on the one core and made the
    // caller wait for it at each op. One thread keeps those ops on the calling thread, inside the
    // actor's pool (see `actor.rs`); a value in the environment wins.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Safety: first thing in main, before any thread exists.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    std::process::exit(oxrl::cli::main());
}
