//! Injected faults, for the tests of fault isolation (cargo feature `failpoints`; without it
//! these are empty functions the compiler removes).
//!
//! `OXRL_FAILPOINT_PANIC=TEXT`: every actor job on a thread whose name contains TEXT panics.
//! Worker ranks run on threads named `oxrl-{model id}-{rank}` and engines on `oxrl-engine…`, so a
//! test can make one training model's workers panic and check that only its requests fail.

/// Called at the start of every actor job.
pub fn actor_job() {
    #[cfg(feature = "failpoints")]
    if let (Ok(text), Some(name)) = (std::env::var("OXRL_FAILPOINT_PANIC"), std::thread::current().name()) {
        if !text.is_empty() && name.contains(&text) {
            panic!("failpoint OXRL_FAILPOINT_PANIC: an injected panic on thread {name}");
        }
    }
}
