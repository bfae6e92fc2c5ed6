//! `oxrl init-model`: a random-init model and a byte-level tokenizer in the HF layout.

use std::path::PathBuf;

use crate::model::model_config::{Arch, ModelShape};
use crate::model::tokenizer::BYTE_LEVEL_VOCAB_SIZE;
use crate::model::{init, weights};

#[derive(clap::Args)]
pub struct Args {
    /// llama, qwen2 or qwen3.
    #[arg(long, default_value = "qwen3")]
    arch: String,
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads (GQA); default: --heads.
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Default: hidden / heads.
    #[arg(long)]
    head_dim: Option<usize>,
    /// MLP width; default: 4 × hidden.
    #[arg(long)]
    intermediate: Option<usize>,
    /// At least the tokenizer's 259 tokens.
    #[arg(long, default_value_t = BYTE_LEVEL_VOCAB_SIZE)]
    vocab: usize,
    #[arg(long, default_value_t = 2048)]
    max_position: usize,
    #[arg(long, default_value_t = 10000.0)]
    rope_theta: f64,
    /// Tie the output projection to the input embeddings.
    #[arg(long)]
    tie: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Storage dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let arch =
        Arch::parse(&a.arch).ok_or_else(|| anyhow::anyhow!("unknown --arch `{}` (llama, qwen2, qwen3)", a.arch))?;
    anyhow::ensure!(
        a.vocab >= BYTE_LEVEL_VOCAB_SIZE,
        "--vocab {} is smaller than the tokenizer's {BYTE_LEVEL_VOCAB_SIZE} tokens",
        a.vocab
    );
    anyhow::ensure!(a.heads > 0 && a.hidden > 0 && a.layers > 0, "--hidden, --layers and --heads must be positive");
    let head_dim = a.head_dim.unwrap_or(a.hidden / a.heads);
    let shape = ModelShape {
        vocab_size: a.vocab,
        hidden_size: a.hidden,
        intermediate_size: a.intermediate.unwrap_or(4 * a.hidden),
        num_layers: a.layers,
        num_heads: a.heads,
        num_kv_heads: a.kv_heads.unwrap_or(a.heads),
        head_dim,
        rope_theta: a.rope_theta,
        max_position_embeddings: a.max_position,
        tie_word_embeddings: a.tie,
    };
    let dtype = weights::parse_dtype(&a.dtype)?;
    let model = init::write_random_model(&a.out, arch, &shape, a.seed, dtype)?;
    eprintln!("wrote a {} model with {} parameters to {}", arch.model_type(), model.num_params(), a.out.display());
    Ok(())
}
