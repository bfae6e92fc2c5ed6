//! Child processes that run the user's code (the Python reward and env pool, the W&B worker):
//! in a process group of their own with SIGINT ignored (Ctrl-C is the trainer's, which then
//! stops them itself) and, on Linux, killed with the thread that starts them
//! (`PR_SET_PDEATHSIG`), so that a trainer killed outright leaves none behind.

use std::process::{Child, Command};

/// Starts the child in a process group of its own with SIGINT ignored and, on Linux, killed
/// with the thread that starts it.
#[cfg(unix)]
pub fn detach(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    let parent = std::process::id();
    // SAFETY: between fork and exec the closure only makes async-signal-safe calls (signal,
    // prctl, getppid) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before prctl: no signal will come.
                if libc::getppid() as u32 != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
            }
            let _ = parent;
            Ok(())
        });
    }
}

#[cfg(not(unix))]
pub fn detach(_cmd: &mut Command) {}

/// Kills the child's process group (its own: [`detach`]), so anything it started goes too.
#[cfg(unix)]
pub fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) with a process group id; no memory is touched.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
    }
}

#[cfg(not(unix))]
pub fn kill_group(child: &mut Child) {
    let _ = child.kill();
}
