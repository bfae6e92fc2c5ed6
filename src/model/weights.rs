//! The Hugging Face weight files' names and dtype names. Reading and writing the tensors
//! themselves is [`super::named_tensors::NamedTensors`]'s job.

use candle_core::DType;

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

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}
