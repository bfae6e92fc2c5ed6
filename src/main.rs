//! The `oxrl` command line (cli::main), with mimalloc as the allocator.
//!
//! Why mimalloc: glibc gave freed memory back to the kernel between steps — past its trim
//! threshold on the main heap, and on worker, engine and rayon threads (where all tensor work runs)
//! whenever one of their 64 MiB arena heaps emptied, at the end of every step, whatever the
//! threshold — so each step's buffers were page-faulted in and zeroed again, even with glibc tuned
//! by `mallopt`. Forcing glibc to one arena removed the faults but slowed the RL demo (its threads
//! contending for one lock). mimalloc keeps memory per thread: faster decoding, training and RL
//! demo than glibc with `mallopt` in a same-run A/B (BENCHMARKS.md, "mimalloc as the binary's
//! allocator").
//!
//! mimalloc hands memory freed for a second back to the kernel (its purge delay, 1 s by default):
//! a prompt prefill's megabyte buffers, freed between batches, came back as fresh pages (some of
//! 2 MiB huge pages, zeroed by the kernel) in every decode run. Ten seconds keeps a step's memory
//! from one step to the next.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

extern "C" {
    /// mimalloc's option setter (`mimalloc.h`), linked with the allocator.
    fn mi_option_set(option: std::os::raw::c_int, value: std::os::raw::c_long);
}

/// `mi_option_purge_delay` in mimalloc v3's `mi_option_e`.
const MI_OPTION_PURGE_DELAY: std::os::raw::c_int = 15;

fn main() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // Safety: a plain option store, before any allocation this setting would affect.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 10_000) };
    }
    // candle's elementwise ops on 64 Ki elements and more run on a process-wide pool of its own
    // (one thread per physical core less one, spinning between ops), outside every actor's thread
    // budget: under `--threads 1` it put a second, spinning thread on the one core and made the
    // caller wait for it at each op. One thread keeps those ops on the calling thread, inside the
    // actor's pool (see `actor.rs`); a value in the environment wins.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Safety: first thing in main, before any thread exists.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let code = oxrl::cli::main();
    // Where a process that does not exit stops (scripts/gpu_check.sh sets it): before this line
    // or in the exit itself.
    if std::env::var_os("OXRL_TRACE_EXIT").is_some() {
        eprintln!("oxrl: the command returned {code}; exiting");
    }
    if !oxrl::model::weights::opened_cuda_devices().is_empty() {
        end_if_exit_hangs(code);
    }
    std::process::exit(code);
}

/// How long a process that used a GPU may take to exit once its command has returned.
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(15);

/// On a GPU, processes were seen spinning in their exit for minutes after their work was done
/// and their result printed (the CUDA driver's teardown; BENCHMARKS.md, cause not yet found).
/// The command's output is flushed and a thread ends the process with the command's exit code
/// if the exit has not within [`EXIT_GRACE`] (first printing every thread's stack where
/// `OXRL_TRACE_EXIT` is set).
fn end_if_exit_hangs(code: i32) {
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::thread::spawn(move || {
        std::thread::sleep(EXIT_GRACE);
        eprintln!("oxrl: the process had not exited {} s after its command returned: ending it", EXIT_GRACE.as_secs());
        if std::env::var_os("OXRL_TRACE_EXIT").is_some() {
            print_thread_stacks();
        }
        // Safety: ends the process at once; the command's work is done and its output flushed.
        unsafe { libc::_exit(code) };
    });
}

/// Each other thread's name and stack on stderr, each printed by the thread itself from a signal
/// handler: where a process that does not exit spins. Not async-signal-safe (it allocates and
/// takes stderr's lock): a diagnostic for a process that is ended right after, whatever the
/// handlers do; each thread gets a moment and the caller goes on.
fn print_thread_stacks() {
    extern "C" fn print_own_stack(_: libc::c_int) {
        // Safety: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        eprintln!("oxrl: thread {tid} at exit:\n{}", std::backtrace::Backtrace::force_capture());
    }
    // Safety: installs a handler for a signal nothing else in the process uses.
    unsafe { libc::signal(libc::SIGUSR2, print_own_stack as extern "C" fn(libc::c_int) as libc::sighandler_t) };
    // Safety: getpid and gettid have no preconditions.
    let (pid, me) = unsafe { (libc::getpid(), libc::gettid()) };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
    for tid in tasks.flatten().filter_map(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok()) {
        if tid == me {
            continue;
        }
        let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
        let state = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
        // The state is the field after the parenthesised name.
        let state = state.rsplit_once(") ").map_or("?", |(_, rest)| &rest[..1.min(rest.len())]);
        eprintln!("oxrl: thread {tid} ({}), state {state}: signalled for its stack", name.trim());
        // Safety: signals one thread of this process with the signal whose handler is set above.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGUSR2) };
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
}
