//! What this process holds in memory, as the kernel counts it: the peak resident set size
//! (`VmHWM` of `/proc/self/status`, the high-water mark of pages in RAM over the process's life)
//! and the resident set now (`VmRSS`), read when asked. Other systems have no such file: the peak is then unknown (NaN, written as
//! `null` in a metrics line).
//!
//! And on a GPU, the most device memory in use at once ([`device_peak_bytes`]): the high-water
//! mark of the CUDA memory pool that candle's allocations draw on (`cuMemAllocAsync`), what
//! PyTorch's `max_memory_allocated` counts for its own allocator.

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

/// The most memory in use at once on `device` since it was opened or since the last
/// [`reset_device_peak`], in bytes: the used-memory high-water mark of the device's current
/// CUDA memory pool. None off CUDA, or where allocations bypass a pool.
pub fn device_peak_bytes(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::{result::mem_pool, sys};
        let pool = cuda_pool(device)?;
        let mut bytes: u64 = 0;
        // Safety: a valid pool, and the attribute's value is a u64 (cuuint64_t).
        let read = unsafe {
            mem_pool::get_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut bytes as *mut u64).cast(),
            )
        };
        read.ok().map(|_| bytes)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// Starts [`device_peak_bytes`] over from the memory in use now.
pub fn reset_device_peak(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::{result::mem_pool, sys};
        let Some(pool) = cuda_pool(device) else { return };
        let mut zero: u64 = 0;
        // Safety: a valid pool; setting the high-water mark takes a u64 zero.
        let _ = unsafe {
            mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        };
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// The peak of [`device_peak_bytes`] summed over the CUDA devices this process has opened, in
/// gigabytes (10⁹ bytes); None where none is open or none reports one.
pub fn device_peak_gb() -> Option<f64> {
    let peaks: Vec<u64> = crate::model::weights::opened_cuda_devices().iter().filter_map(device_peak_bytes).collect();
    (!peaks.is_empty()).then(|| peaks.iter().sum::<u64>() as f64 / GB)
}

/// The memory pool `device`'s allocations come from, where they come from one.
#[cfg(feature = "cuda")]
fn cuda_pool(device: &candle_core::Device) -> Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    let candle_core::Device::Cuda(d) = device else { return None };
    let stream = d.cuda_stream();
    let context = stream.context();
    if !context.has_async_alloc() {
        return None;
    }
    context.bind_to_thread().ok()?;
    // Safety: the device of a context this process holds.
    unsafe { candle_core::cuda_backend::cudarc::driver::result::device::get_mem_pool(context.cu_device()) }.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off CUDA there is no device peak, and a reset is a no-op.
    #[test]
    fn no_device_peak_on_the_cpu() {
        reset_device_peak(&candle_core::Device::Cpu);
        assert_eq!(device_peak_bytes(&candle_core::Device::Cpu), None);
    }

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
