//! The Hugging Face weight files' names, dtype names and device names. Reading and writing the tensors
//! themselves is [`super::named_tensors::NamedTensors`]'s job.

use candle_core::{DType, Device};

use crate::locks::lock;
use crate::{Error, Result};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Parses a dtype name as used in configs and on the command line.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        "f64" | "float64" => Ok(DType::F64),
        _ => Err(Error::input(format!("unknown dtype `{name}` (expected f32, bf16, f16 or f64)"))),
    }
}

/// Parses a device name as used in configs and on the command line: `cpu`, `cuda` (= `cuda:0`)
/// or `cuda:N`. A CUDA device needs a build with `--features cuda` (otherwise a clear error, no
/// panic) and a GPU (otherwise the driver's error). Each ordinal is opened once per process and
/// the same [`Device`] is returned after: candle gives every `Device::new_cuda` its own id, and
/// tensors of two ids can't meet in one op (a worker's weights and an engine's, say).
pub fn parse_device(name: &str) -> Result<Device> {
    let ordinal = match name {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        _ => match name.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => n,
            None => return Err(Error::input(format!("unknown device `{name}` (expected cpu, cuda or cuda:N)"))),
        },
    };
    check_device_name(name)?;
    cuda_device(ordinal)
}

/// Checks a device name without opening the device (config validation).
pub fn check_device_name(name: &str) -> Result<()> {
    let ok = matches!(name, "cpu" | "cuda") || name.strip_prefix("cuda:").is_some_and(|n| n.parse::<usize>().is_ok());
    if !ok {
        return Err(Error::input(format!("unknown device `{name}` (expected cpu, cuda or cuda:N)")));
    }
    if name != "cpu" && !cfg!(feature = "cuda") {
        return Err(Error::input(format!(
            "device `{name}`: this oxrl was built without CUDA; rebuild with `cargo build --release --features cuda` \
             (scripts/install_cuda.sh installs the toolkit)"
        )));
    }
    Ok(())
}

/// The CUDA devices this process has opened, by ordinal.
static OPENED: std::sync::Mutex<Vec<(usize, Device)>> = std::sync::Mutex::new(Vec::new());

/// The CUDA devices this process has opened ([`cuda_device`]), in the order it opened them.
pub fn opened_cuda_devices() -> Vec<Device> {
    lock(&OPENED).iter().map(|(_, d)| d.clone()).collect()
}

/// Whether this process runs candle's backward as upstream has it on a GPU
/// (`OXRL_CANDLE_ZERO_FIRST=1`: each node's first gradient added into a zero buffer, and
/// gradients summed by candle's add; see vendor/candle-core), to measure the patch against it.
/// Read once.
pub fn upstream_backward() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("OXRL_CANDLE_ZERO_FIRST").as_deref() == Ok("1"))
}

/// The process's one [`Device`] for CUDA ordinal `ordinal`, opened on first use.
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    check_device_name(&format!("cuda:{ordinal}"))?;
    let mut opened = lock(&OPENED);
    if let Some((_, d)) = opened.iter().find(|(n, _)| *n == ordinal) {
        return Ok(d.clone());
    }
    let device = Device::new_cuda(ordinal).map_err(|e| {
        // The driver's error, without the backtrace candle may attach.
        let e = e.to_string();
        let e = e.lines().next().unwrap_or_default();
        Error::input(format!("device `cuda:{ordinal}`: no CUDA device could be opened: {e}"))
    })?;
    candle_core::backprop::set_zero_first_gradients_off_cpu(upstream_backward());
    if !upstream_backward() {
        candle_core::backprop::set_gradient_add(crate::model::ops::add::gradient_add);
    }
    opened.push((ordinal, device.clone()));
    Ok(device)
}

/// The name [`parse_device`] reads back: `cpu` or `cuda:N`.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}
