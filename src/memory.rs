//! What this process holds in memory, as the kernel counts it: the peak resident set size
//! (`VmHWM` of `/proc/self/status`, the high-water mark of pages in RAM over the process's life)
//! and the resident set now (`VmRSS`), read when asked. Other systems have no such file: the peak is then unknown (NaN, written as
//! `null` in a metrics line).

// Links mimalloc (the `oxrl` binary's allocator, src/main.rs) for `mi_collect`.
use mimalloc as _;

extern "C" {
    /// mimalloc's collection (`mimalloc.h`): with `force`, frees what it holds for reuse.
    fn mi_collect(force: bool);
}

/// Bytes in the `gb` of `peak_rss_gb` (decimal gigabytes).
pub const GB: f64 = 1e9;

/// The process's peak resident set size in bytes, if the system reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes(&std::fs::read_to_string("/proc/self/status").ok()?, "VmHWM")
}

/// The peak resident set size in gigabytes (10⁹ bytes), NaN where unknown.
pub fn peak_rss_gb() -> f64 {
    peak_rss_bytes().map_or(f64::NAN, |b| b as f64 / GB)
}

/// The resident set size now in gigabytes, NaN where unknown.
pub fn resident_rss_gb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| status_bytes(&s, "VmRSS"))
        .map_or(f64::NAN, |b| b as f64 / GB)
}

/// Hands the memory the allocator keeps for reuse back to the kernel now, rather than after its
/// purge delay (src/main.rs): after a sharded model has released the weights it does not own,
/// what was freed would otherwise stay resident and be counted in the peak for seconds. A no-op
/// for memory from another allocator.
pub fn return_freed() {
    // Safety: a collection call with no arguments to uphold, safe from any thread.
    unsafe { mi_collect(true) };
}

/// The field `name` (`VmHWM:   123456 kB`) of a `/proc/PID/status` text, in bytes.
fn status_bytes(status: &str, name: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?;
    let kb: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_high_water_mark() {
        let status = "Name:\toxrl\nVmPeak:\t  900 kB\nVmHWM:\t   1234 kB\nVmRSS:\t  1000 kB\n";
        assert_eq!(status_bytes(status, "VmHWM"), Some(1234 * 1024));
        assert_eq!(status_bytes(status, "VmRSS"), Some(1000 * 1024));
        assert_eq!(status_bytes("Name:\toxrl\n", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:\t12 MB\n", "VmHWM"), None);
        if cfg!(target_os = "linux") {
            // Now first: the peak read after it is at least that.
            let now = resident_rss_gb();
            let peak = peak_rss_gb();
            // This test process holds at least a megabyte and less than a terabyte.
            assert!(peak > 1e-3 && peak < 1e3 && now <= peak, "{peak} {now}");
        }
    }
}
