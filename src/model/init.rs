//! Seeded random initialisation, for `oxrl init-model`, fresh LoRA adapters and tests.
//!
//! Weights ~ N(0, 0.02²) (transformers' `initializer_range`), norm weights = 1, biases = 0.
//! Qwen3.5 as transformers initialises it: its `1 + w` norms' w = 0 (the DeltaNet's gated norm
//! 1), a DeltaNet's dt_bias = 1 and A_log = log(U(0.01, 16)).
//! Normal samples come from Box–Muller over a seeded `StdRng`, so the same seed gives the same
//! model on every machine.

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::model_config::ModelConfig;
use super::transformer::Transformer;
use crate::Result;

pub const INITIALIZER_RANGE: f64 = 0.02;

pub fn normal(rng: &mut StdRng, shape: &[usize], std: f64, dtype: DType, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f64::consts::PI * u2;
        v.push((r * th.cos() * std) as f32);
        v.push((r * th.sin() * std) as f32);
    }
    v.truncate(n);
    Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
}

pub fn uniform(rng: &mut StdRng, shape: &[usize], bound: f64, dtype: DType, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32).collect();
    Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
}

/// A randomly initialised model of the given config.
pub fn random_model(config: ModelConfig, seed: u64, dtype: DType, device: &Device) -> Result<Transformer> {
    let mut rng = StdRng::seed_from_u64(seed);
    let unit_offset = config.norm_unit_offset;
    Transformer::build(config, dtype, device, &mut |name, shape| {
        if name.ends_with("norm.weight") && unit_offset && !name.ends_with("linear_attn.norm.weight") {
            Ok(Tensor::zeros(shape, dtype, device)?)
        } else if name.ends_with("norm.weight") || name.ends_with("dt_bias") {
            Ok(Tensor::ones(shape, dtype, device)?)
        } else if name.ends_with("A_log") {
            let v: Vec<f32> =
                (0..shape.iter().product()).map(|_| (0.01 + rng.random::<f64>() * 15.99).ln() as f32).collect();
            Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
        } else if name.ends_with(".bias") {
            Ok(Tensor::zeros(shape, dtype, device)?)
        } else {
            normal(&mut rng, shape, INITIALIZER_RANGE, dtype, device)
        }
    })
}

/// Writes a random model of `arch` and `shape` with the byte-level tokenizer (ChatML template)
/// to `dir` in the HF layout: config.json, model.safetensors (stored as `dtype`),
/// generation_config.json and the tokenizer files. Returns the model (f32).
pub fn write_random_model(
    dir: &std::path::Path,
    arch: super::model_config::Arch,
    shape: &super::model_config::ModelShape,
    seed: u64,
    dtype: DType,
) -> Result<Transformer> {
    write_random_model_from(dir, ModelConfig::new_json(arch, shape), seed, dtype)
}

/// [`write_random_model`] from a config.json value.
pub fn write_random_model_from(
    dir: &std::path::Path,
    config: serde_json::Value,
    seed: u64,
    dtype: DType,
) -> Result<Transformer> {
    let path = dir.join("config.json");
    let config = ModelConfig::from_value(config, &path)?;
    let model = random_model(config, seed, DType::F32, &Device::Cpu)?;
    model.save(dir, dtype)?;
    crate::files::write_json(
        &dir.join("generation_config.json"),
        &serde_json::json!({"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}),
    )?;
    super::tokenizer::write_byte_level_tokenizer(dir)?;
    Ok(model)
}
