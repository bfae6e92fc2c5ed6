//! `oxrl init-model`: a random-init model and a byte-level tokenizer in the HF layout. For
//! `--arch qwen3_5` the hybrid stack's options: which layers are Gated DeltaNet layers
//! (`--layer-types`, or every `--full-attention-interval`-th full attention) and their sizes; for
//! `--arch qwen3_moe` the experts (how many, how many per token, their width, which layers); for
//! `--arch gemma3` the sliding window, which layers slide, and their RoPE base.

use std::path::PathBuf;

use crate::model::model_config::{Arch, ModelConfig, ModelShape};
use crate::model::tokenizer::BYTE_LEVEL_VOCAB_SIZE;
use crate::model::{init, weights};

#[derive(clap::Args)]
pub struct Args {
    /// llama, qwen2, qwen3, qwen3_5, qwen3_moe or gemma3.
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
    #[command(flatten)]
    hybrid: HybridArgs,
    #[command(flatten)]
    moe: MoeArgs,
    #[command(flatten)]
    sliding: SlidingArgs,
}

/// Gemma 3's sliding-window layers (`--arch gemma3` only).
#[derive(clap::Args)]
struct SlidingArgs {
    /// Keys a sliding layer's query sees, itself included; default 512.
    #[arg(long)]
    sliding_window: Option<usize>,
    /// Every N-th layer global, the others sliding; default 6.
    #[arg(long)]
    sliding_window_pattern: Option<usize>,
    /// The sliding layers' RoPE base (--rope-theta is the global layers'); default 10000.
    #[arg(long)]
    rope_local_theta: Option<f64>,
}

impl SlidingArgs {
    fn given(&self) -> bool {
        self.sliding_window.is_some() || self.sliding_window_pattern.is_some() || self.rope_local_theta.is_some()
    }

    /// Sets the sliding-window fields of a gemma3 config.json (checked when it is parsed).
    fn apply(&self, v: &mut serde_json::Value, shape: &ModelShape) -> anyhow::Result<()> {
        if let Some(w) = self.sliding_window {
            anyhow::ensure!(w > 0, "--sliding-window must be positive");
            v["sliding_window"] = w.into();
        }
        if let Some(n) = self.sliding_window_pattern {
            anyhow::ensure!(n > 0, "--sliding-window-pattern must be positive");
            let types: Vec<&str> = (0..shape.num_layers)
                .map(|i| if (i + 1) % n == 0 { "full_attention" } else { "sliding_attention" })
                .collect();
            v["layer_types"] = serde_json::json!(types);
        }
        if let Some(t) = self.rope_local_theta {
            anyhow::ensure!(t > 0.0, "--rope-local-theta must be positive");
            v["rope_parameters"]["sliding_attention"]["rope_theta"] = t.into();
        }
        Ok(())
    }
}

/// Qwen3-MoE's experts (`--arch qwen3_moe` only).
#[derive(clap::Args)]
struct MoeArgs {
    /// Experts per sparse MLP.
    #[arg(long)]
    num_experts: Option<usize>,
    /// Experts each token is routed to (the router's top-k).
    #[arg(long)]
    experts_per_token: Option<usize>,
    /// Each expert's width; default: --intermediate / 8.
    #[arg(long)]
    moe_intermediate_size: Option<usize>,
    /// Every N-th layer sparse, the others dense MLPs of --intermediate.
    #[arg(long)]
    decoder_sparse_step: Option<usize>,
    /// Layers with a dense MLP, comma-separated indices.
    #[arg(long, value_delimiter = ',')]
    mlp_only_layers: Option<Vec<usize>>,
}

impl MoeArgs {
    fn given(&self) -> bool {
        self.num_experts.is_some()
            || self.experts_per_token.is_some()
            || self.moe_intermediate_size.is_some()
            || self.decoder_sparse_step.is_some()
            || self.mlp_only_layers.is_some()
    }

    /// Sets the experts' fields of a qwen3_moe config.json (checked when it is parsed).
    fn apply(&self, v: &mut serde_json::Value) {
        let fields = [
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.experts_per_token),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ];
        for (key, value) in fields {
            if let Some(x) = value {
                v[key] = x.into();
            }
        }
        if let Some(layers) = &self.mlp_only_layers {
            v["mlp_only_layers"] = serde_json::json!(layers);
        }
    }
}

/// Qwen3.5's hybrid stack (`--arch qwen3_5` only).
#[derive(clap::Args)]
struct HybridArgs {
    /// Each layer's mixer, comma-separated: `linear` (a Gated DeltaNet) or `full` (gated
    /// attention), one per layer; default: every --full-attention-interval-th layer full.
    #[arg(long, value_delimiter = ',')]
    layer_types: Option<Vec<String>>,
    /// Every N-th layer full attention, the others DeltaNet layers (when --layer-types is not
    /// given).
    #[arg(long, default_value_t = 4)]
    full_attention_interval: usize,
    /// DeltaNet key heads (q and k); default: --heads.
    #[arg(long)]
    linear_key_heads: Option<usize>,
    /// DeltaNet value heads (a multiple of the key heads); default: --heads.
    #[arg(long)]
    linear_value_heads: Option<usize>,
    /// DeltaNet key head size; default: the attention's head size.
    #[arg(long)]
    linear_key_head_dim: Option<usize>,
    /// DeltaNet value head size; default: the attention's head size.
    #[arg(long)]
    linear_value_head_dim: Option<usize>,
    /// The DeltaNet's causal convolution width.
    #[arg(long, default_value_t = 4)]
    linear_conv_kernel: usize,
    /// The rotated share of each attention head.
    #[arg(long, default_value_t = 0.25)]
    partial_rotary_factor: f64,
}

impl HybridArgs {
    /// Whether any option differs from its default (they only apply to --arch qwen3_5).
    fn given(&self) -> bool {
        self.layer_types.is_some()
            || self.full_attention_interval != 4
            || self.linear_key_heads.is_some()
            || self.linear_value_heads.is_some()
            || self.linear_key_head_dim.is_some()
            || self.linear_value_head_dim.is_some()
            || self.linear_conv_kernel != 4
            || self.partial_rotary_factor != 0.25
    }

    /// Sets the hybrid fields of a qwen3_5 config.json (checked when it is parsed).
    fn apply(&self, v: &mut serde_json::Value, shape: &ModelShape) -> anyhow::Result<()> {
        let types: Vec<&str> = match &self.layer_types {
            Some(t) => {
                anyhow::ensure!(
                    t.len() == shape.num_layers,
                    "--layer-types lists {} layers, --layers is {}",
                    t.len(),
                    shape.num_layers
                );
                t.iter()
                    .map(|x| match x.trim() {
                        "linear" | "linear_attention" => Ok("linear_attention"),
                        "full" | "full_attention" => Ok("full_attention"),
                        other => Err(anyhow::anyhow!("--layer-types: `{other}` is not `linear` or `full`")),
                    })
                    .collect::<anyhow::Result<_>>()?
            }
            None => {
                let n = self.full_attention_interval;
                anyhow::ensure!(n > 0, "--full-attention-interval must be positive");
                (0..shape.num_layers)
                    .map(|i| if (i + 1) % n == 0 { "full_attention" } else { "linear_attention" })
                    .collect()
            }
        };
        v["layer_types"] = serde_json::json!(types);
        v["linear_num_key_heads"] = self.linear_key_heads.unwrap_or(shape.num_heads).into();
        v["linear_num_value_heads"] = self.linear_value_heads.unwrap_or(shape.num_heads).into();
        v["linear_key_head_dim"] = self.linear_key_head_dim.unwrap_or(shape.head_dim).into();
        v["linear_value_head_dim"] = self.linear_value_head_dim.unwrap_or(shape.head_dim).into();
        v["linear_conv_kernel_dim"] = self.linear_conv_kernel.into();
        v["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor.into();
        Ok(())
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let arch = Arch::parse(&a.arch).ok_or_else(|| {
        anyhow::anyhow!("unknown --arch `{}` (llama, qwen2, qwen3, qwen3_5, qwen3_moe, gemma3)", a.arch)
    })?;
    anyhow::ensure!(
        arch == Arch::Qwen3_5 || !a.hybrid.given(),
        "--layer-types, --full-attention-interval, --linear-* and --partial-rotary-factor are for --arch qwen3_5"
    );
    anyhow::ensure!(
        arch == Arch::Qwen3Moe || !a.moe.given(),
        "--num-experts, --experts-per-token, --moe-intermediate-size, --decoder-sparse-step and \
         --mlp-only-layers are for --arch qwen3_moe"
    );
    anyhow::ensure!(
        arch == Arch::Gemma3 || !a.sliding.given(),
        "--sliding-window, --sliding-window-pattern and --rope-local-theta are for --arch gemma3"
    );
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
    let mut config = ModelConfig::new_json(arch, &shape);
    if arch == Arch::Qwen3_5 {
        a.hybrid.apply(&mut config, &shape)?;
    }
    if arch == Arch::Qwen3Moe {
        a.moe.apply(&mut config);
    }
    if arch == Arch::Gemma3 {
        a.sliding.apply(&mut config, &shape)?;
    }
    let model = init::write_random_model_from(&a.out, config, a.seed, dtype)?;
    eprintln!("wrote a {} model with {} parameters to {}", arch.model_type(), model.num_params(), a.out.display());
    Ok(())
}
