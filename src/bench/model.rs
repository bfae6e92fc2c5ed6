//! The benchmark model of the issues: qwen3-shaped, hidden 256, 4 layers, 4 heads of 64 (2 kv
//! heads), MLP 1024, vocab 4096, max position 1024, untied — 6.0 M parameters — with the crate's
//! seeded initialisation ([`crate::model::init`]: N(0, 0.02²), norms 1), so the same seed gives
//! the same weights in `cargo bench`, `oxrl bench` and the HF directory [`write`](fn@write) makes.

use std::path::Path;

use candle_core::{DType, Device};

use super::workloads;
use crate::model::model_config::{Arch, ModelConfig, ModelShape};
use crate::model::{init, Transformer};
use crate::Result;

/// The seed of the benchmark model's weights.
pub const SEED: u64 = 0;
/// The file, beside the model, that holds the workloads' tokens for the peers.
pub const WORKLOADS_FILE: &str = "bench_workloads.json";

pub fn shape() -> ModelShape {
    ModelShape {
        vocab_size: 4096,
        hidden_size: 256,
        intermediate_size: 1024,
        num_layers: 4,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        rope_theta: 10000.0,
        max_position_embeddings: 1024,
        tie_word_embeddings: false,
    }
}

pub fn config() -> Result<ModelConfig> {
    ModelConfig::from_value(ModelConfig::new_json(Arch::Qwen3, &shape()), "benchmark model".as_ref())
}

/// The benchmark model with the weights of `seed`, in `dtype` on `device` (drawn in f32 and
/// rounded to `dtype`, so every dtype rounds the one model that [`write`](fn@write) stores).
pub fn build(seed: u64, dtype: DType, device: &Device) -> Result<Transformer> {
    init::random_model(config()?, seed, dtype, device)
}

/// Writes the benchmark model (seed [`SEED`], f32) as a Hugging Face directory with the
/// byte-level tokenizer, and [`WORKLOADS_FILE`]: the training batch's input and target tokens
/// and the decoding prompts, as `oxrl bench` builds them for this model.
pub fn write(dir: &Path) -> Result<()> {
    init::write_random_model(dir, Arch::Qwen3, &shape(), SEED, DType::F32)?;
    let vocab = shape().vocab_size;
    let (b, t) = (workloads::TRAIN_BATCH, workloads::TRAIN_SEQ);
    let prompts: Vec<Vec<u32>> = (0..64).map(|r| workloads::prompt(r, workloads::PROMPT_LEN, vocab)).collect();
    let json = serde_json::json!({
        "train": {
            "input_tokens": (0..b).map(|r| workloads::tokens(r, t, 0, vocab)).collect::<Vec<_>>(),
            "target_tokens": (0..b).map(|r| workloads::tokens(r, t, workloads::TARGET_SALT, vocab)).collect::<Vec<_>>(),
        },
        "decode": {"prompts": prompts, "new_tokens": workloads::NEW_TOKENS},
    });
    crate::files::write_json(&dir.join(WORKLOADS_FILE), &json)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The directory the peers load holds the very weights `build` makes, and the workloads'
    /// tokens as oxrl builds them.
    #[test]
    fn written_model_is_the_built_one() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path()).unwrap();
        let loaded = Transformer::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
        let built = build(SEED, DType::F32, &Device::Cpu).unwrap();
        for ((n, a), (m, b)) in loaded.named_params().iter().zip(built.named_params()) {
            assert_eq!(n, &m);
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(d, 0.0, "{n}");
        }
        let w = crate::files::read_json(&dir.path().join(WORKLOADS_FILE)).unwrap();
        let batch = workloads::train_batch(workloads::TRAIN_BATCH, workloads::TRAIN_SEQ, 4096);
        assert_eq!(w["train"]["input_tokens"][3], serde_json::json!(batch[3].input_tokens));
        assert_eq!(w["decode"]["prompts"][5], serde_json::json!(workloads::prompt(5, 16, 4096)));
    }
}
