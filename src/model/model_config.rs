//! `config.json` of a Hugging Face decoder-only model, for the Llama, Qwen2, Qwen3, Qwen3.5 and
//! Qwen3-MoE families.
//!
//! The families share one shape (pre-norm blocks of a token mixer and a SwiGLU MLP); they differ
//! only in details captured here as flags:
//! - Llama: optional `attention_bias` / `mlp_bias`, optional Llama-3 `rope_scaling`;
//! - Qwen2: biases on the q/k/v projections (never on o_proj);
//! - Qwen3: per-head RMSNorm on q and k before RoPE, and an explicit `head_dim`;
//! - Qwen3.5 (`qwen3_5_text`): `layer_types` mixes Gated DeltaNet layers (`linear_attention`,
//!   [`DeltaNetConfig`]) with gated full-attention layers (an output gate from a doubled q_proj,
//!   q/k norms, RoPE on the first `partial_rotary_factor` of each head); every RMSNorm but the
//!   DeltaNet's gated one scales by `1 + weight`. Released checkpoints (`qwen3_5`, a
//!   vision-language model) keep these settings under `text_config` and the language model's
//!   weights under `model.language_model.*`; the vision tower and an MTP head are left aside.
//! - Qwen3-MoE (`qwen3_moe`): Qwen3's attention; the MLP of a sparse layer is a router and
//!   `num_experts` SwiGLU experts, of which each token uses its top `num_experts_per_tok`
//!   ([`MoeConfig`]).
//! - Gemma 3 (`gemma3_text`): sliding-window and global layers (`layer_types`), sandwich norms,
//!   GELU-tanh MLP, scaled embeddings, q/k norms, `1 + weight` RMSNorms; its own fields are read
//!   by [`super::gemma3`].
//!
//! RoPE settings are read from `rope_parameters` (transformers ≥ 5: `rope_theta` and the scaling
//! in one object) or from the older `rope_theta` + `rope_scaling`.
//!
//! Fields we do not model (dropout, initializer range, ...) are ignored; fields whose value would
//! change the computation and that we do not support (another activation, Qwen2's sliding windows,
//! quantisation, an unknown rope scaling) are errors that name the field.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::files::JsonFields;
use crate::Result;

/// The supported model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    /// Qwen3.5's hybrid stack (`qwen3_5_text`).
    Qwen3_5,
    /// Qwen3's attention with sparse mixture-of-experts MLPs (`qwen3_moe`).
    Qwen3Moe,
    /// Gemma 3 text (`gemma3_text`): sliding-window and global layers, [`super::gemma3`].
    Gemma3,
}

/// The names `model_type` errors list.
const SUPPORTED: &str = "llama, qwen2, qwen3, qwen3_5_text, qwen3_5, qwen3_moe, gemma3_text";

impl Arch {
    pub fn parse(name: &str) -> Option<Arch> {
        match name.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Some(Arch::Llama),
            "qwen2" | "qwen2forcausallm" => Some(Arch::Qwen2),
            "qwen3" | "qwen3forcausallm" => Some(Arch::Qwen3),
            "qwen3_5" | "qwen3_5_text" | "qwen3_5forcausallm" | "qwen3_5forconditionalgeneration" => {
                Some(Arch::Qwen3_5)
            }
            "qwen3_moe" | "qwen3moeforcausallm" => Some(Arch::Qwen3Moe),
            "gemma3" | "gemma3_text" | "gemma3forcausallm" => Some(Arch::Gemma3),
            _ => None,
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3_5 => "qwen3_5_text",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Gemma3 => "gemma3_text",
        }
    }
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen3_5 => "Qwen3_5ForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
        }
    }
}

/// What a decoder layer mixes tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Softmax attention over a KV cache.
    FullAttention,
    /// A Gated DeltaNet: a recurrent state and a short causal convolution.
    LinearAttention,
    /// Softmax attention over the last `sliding_window` tokens (Gemma 3).
    SlidingAttention,
}

/// The Gated DeltaNet layers' sizes (`linear_*` fields of a Qwen3.5 config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetConfig {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// The causal depthwise convolution's width.
    pub conv_kernel: usize,
}

impl DeltaNetConfig {
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// The sparse mixture-of-experts MLPs of a Qwen3-MoE config.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// `num_experts` (transformers ≥ 5 writes `num_local_experts`).
    pub num_experts: usize,
    /// `num_experts_per_tok`: the k of the router's top-k.
    pub experts_per_token: usize,
    /// Each expert's hidden width (`moe_intermediate_size`).
    pub intermediate_size: usize,
    /// The k chosen probabilities are renormalised to sum to 1 (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Per layer: whether its MLP is sparse (`mlp_only_layers`, `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
    /// The load-balancing loss's weight in transformers' loss (`router_aux_loss_coef`), which
    /// adds it when `output_router_logits`; oxrl's trainers take it from their own option.
    pub router_aux_loss_coef: f64,
    pub output_router_logits: bool,
}

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3's piecewise rescaling of the inverse frequencies.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// Everything the model code needs from `config.json`.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads` (no GQA).
    pub num_key_value_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    /// Default 1e-6.
    pub rms_norm_eps: f64,
    /// Default 10000.
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Default 2048.
    pub max_position_embeddings: usize,
    /// Default false (the HF default for all three families).
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v (Qwen2 always; Llama/Qwen3 per `attention_bias`, default false).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama/Qwen3 `attention_bias`; never for Qwen2).
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama `mlp_bias`, default false).
    pub mlp_bias: bool,
    /// Qwen3's RMSNorm on q and k.
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// Each layer's token mixer (all full attention but for Qwen3.5).
    pub layer_types: Vec<LayerType>,
    /// The DeltaNet layers' sizes (Qwen3.5).
    pub delta_net: Option<DeltaNetConfig>,
    /// The experts and the router (Qwen3-MoE).
    pub moe: Option<MoeConfig>,
    /// The rotated leading part of each head (`head_dim` but for a partial rotary factor).
    pub rotary_dim: usize,
    /// RMSNorm scales by `1 + weight` (Qwen3.5; its weights start at 0).
    pub norm_unit_offset: bool,
    /// q_proj also gives a per-channel gate, σ(gate) applied to the attention output (Qwen3.5).
    pub attn_output_gate: bool,
    /// The language model's weights are under `model.language_model.*` (a `qwen3_5`
    /// vision-language checkpoint).
    pub language_model_prefix: bool,
    /// Gemma 3's sliding windows, sandwich norms, GELU-tanh MLP and scales.
    pub gemma3: Option<super::gemma3::Gemma3Settings>,
    /// The file as read, so that saving writes back every field transformers expects (for a
    /// vision-language checkpoint, its text model's config: oxrl exports the language model).
    pub raw: Value,
}

/// A required positive integer field.
fn positive(f: &JsonFields, field: &str) -> Result<usize> {
    let v = f.usize(field)?;
    if v == 0 {
        return Err(f.err(field, "must be positive"));
    }
    Ok(v)
}

impl ModelConfig {
    /// Reads `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_value(crate::files::read_json(path)?, path)
    }

    /// Parses a config JSON value; `path` is only used in error messages.
    pub fn from_value(raw: Value, path: &Path) -> Result<Self> {
        let top = JsonFields::new(path, &raw)?;
        // A vision-language Qwen3.5: the language model's settings are its `text_config`.
        let vision_language = top.get("model_type").and_then(Value::as_str) == Some("qwen3_5")
            || (top.get("model_type").is_none()
                && top.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str)
                    == Some("Qwen3_5ForConditionalGeneration"));
        if vision_language {
            return Self::from_vision_language(&raw, path);
        }
        if top.get("model_type").and_then(Value::as_str) == Some("gemma3")
            || top.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str)
                == Some("Gemma3ForConditionalGeneration")
        {
            return Err(super::gemma3::vision_language_refusal(&top));
        }
        let f = top;

        let arch = match f.get("model_type") {
            Some(Value::String(t)) => Arch::parse(t).ok_or_else(|| {
                f.err("model_type", format!("unsupported architecture `{t}` (supported: {SUPPORTED})"))
            })?,
            Some(v) => return Err(f.err("model_type", format!("expected a string, got {v}"))),
            None => match f.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()) {
                Some(t) => Arch::parse(t).ok_or_else(|| {
                    f.err("architectures", format!("unsupported architecture `{t}` (supported: {SUPPORTED})"))
                })?,
                None => return Err(f.err("model_type", "missing (required to know the architecture)")),
            },
        };

        let hidden_size = positive(&f, "hidden_size")?;
        let num_attention_heads = positive(&f, "num_attention_heads")?;
        let num_key_value_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("{num_key_value_heads} must divide num_attention_heads = {num_attention_heads}"),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.err("head_dim", "missing, and hidden_size is not divisible by num_attention_heads"));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(f.err("head_dim", format!("{head_dim} must be even and positive (RoPE rotates pairs)")));
        }

        let activation = if arch == Arch::Gemma3 { "gelu_pytorch_tanh" } else { "silu" };
        if let Some(act) = f.get("hidden_act").or_else(|| f.get("hidden_activation")) {
            if act.as_str() != Some(activation) {
                return Err(f.err("hidden_act", format!("unsupported activation {act} (only \"{activation}\")")));
            }
        }
        if f.bool_or("use_sliding_window", false)? {
            return Err(f.err("use_sliding_window", "sliding-window attention is not supported"));
        }
        let num_hidden_layers = positive(&f, "num_hidden_layers")?;
        let gemma3 = (arch == Arch::Gemma3).then(|| super::gemma3::parse(&f, num_hidden_layers)).transpose()?;
        let layer_types = match &gemma3 {
            Some(g) => g.layer_types.clone(),
            None => parse_layer_types(&f, arch, num_hidden_layers)?,
        };
        let delta_net = match layer_types.contains(&LayerType::LinearAttention) {
            true => Some(DeltaNetConfig {
                num_key_heads: positive(&f, "linear_num_key_heads")?,
                num_value_heads: positive(&f, "linear_num_value_heads")?,
                key_head_dim: positive(&f, "linear_key_head_dim")?,
                value_head_dim: positive(&f, "linear_value_head_dim")?,
                conv_kernel: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            }),
            false => None,
        };
        if let Some(dn) = &delta_net {
            if dn.num_value_heads % dn.num_key_heads != 0 {
                return Err(f.err(
                    "linear_num_key_heads",
                    format!("{} must divide linear_num_value_heads = {}", dn.num_key_heads, dn.num_value_heads),
                ));
            }
            if dn.conv_kernel == 0 {
                return Err(f.err("linear_conv_kernel_dim", "must be positive"));
            }
        }
        let rotary_dim = match arch {
            Arch::Qwen3_5 => {
                let factor = f
                    .get("rope_parameters")
                    .and_then(|p| p.get("partial_rotary_factor"))
                    .or_else(|| f.get("partial_rotary_factor"))
                    .map(|v| v.as_f64().ok_or_else(|| f.err("partial_rotary_factor", "expected a number")))
                    .transpose()?
                    .unwrap_or(0.25);
                // transformers: int(head_dim · factor).
                let dim = (head_dim as f64 * factor) as usize;
                if !(factor > 0.0 && factor <= 1.0 && dim.is_multiple_of(2) && dim > 0) {
                    return Err(f.err(
                        "partial_rotary_factor",
                        format!("{factor} gives {dim} rotary dims of head_dim {head_dim} (must be even, positive)"),
                    ));
                }
                dim
            }
            _ => head_dim,
        };
        let moe = match arch {
            Arch::Qwen3Moe => Some(parse_moe(&f, num_hidden_layers)?),
            _ => None,
        };
        if f.get("quantization_config").is_some() {
            return Err(f.err("quantization_config", "quantised checkpoints are not supported"));
        }
        if f.opt_usize("pretraining_tp")?.unwrap_or(1) != 1 {
            return Err(f.err("pretraining_tp", "only 1 is supported"));
        }

        let rope_scaling = match &gemma3 {
            Some(g) => g.global_rope_scaling.clone(),
            None => parse_rope_scaling(&f)?,
        };
        let attention_bias = f.opt_bool("attention_bias")?;
        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2 => (true, false),
            _ => {
                let b = attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        let rms_norm_eps = f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        if rms_norm_eps <= 0.0 {
            return Err(f.err("rms_norm_eps", "must be positive"));
        }
        // transformers ≥ 5 writes `rope_parameters` (theta inside); older files `rope_theta`.
        let rope_theta = match f.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
            _ if gemma3.is_some() => gemma3.as_ref().map_or(0.0, |g| g.global_rope_theta),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| f.err("rope_parameters.rope_theta", format!("expected a finite number, got {v}")))?,
            None => f.opt_f64("rope_theta")?.unwrap_or(10000.0),
        };
        if rope_theta <= 0.0 {
            return Err(f.err("rope_theta", "must be positive"));
        }

        Ok(ModelConfig {
            arch,
            vocab_size: positive(&f, "vocab_size")?,
            hidden_size,
            intermediate_size: positive(&f, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            tie_word_embeddings: f.bool_or("tie_word_embeddings", arch == Arch::Gemma3)?,
            qkv_bias,
            o_bias,
            mlp_bias: f.bool_or("mlp_bias", false)?,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3_5 | Arch::Qwen3Moe | Arch::Gemma3),
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: f.token_ids("pad_token_id")?.first().copied(),
            layer_types,
            delta_net,
            moe,
            rotary_dim,
            norm_unit_offset: matches!(arch, Arch::Qwen3_5 | Arch::Gemma3),
            attn_output_gate: arch == Arch::Qwen3_5,
            language_model_prefix: false,
            gemma3,
            raw: raw.clone(),
        })
    }

    /// A `qwen3_5` vision-language config: its `text_config` read as a `qwen3_5_text` config
    /// (with the file's `tie_word_embeddings` and token ids where the text config lacks them);
    /// the vision tower's settings are left aside.
    fn from_vision_language(raw: &Value, path: &Path) -> Result<Self> {
        let top = JsonFields::new(path, raw)?;
        let Some(Value::Object(text)) = top.get("text_config") else {
            return Err(top.err("text_config", "missing or not an object (required for model_type qwen3_5)"));
        };
        let mut text = text.clone();
        text.insert("model_type".into(), Value::String(Arch::Qwen3_5.model_type().into()));
        text.insert("architectures".into(), serde_json::json!([Arch::Qwen3_5.hf_class()]));
        for key in ["tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype"] {
            if let (false, Some(v)) = (text.contains_key(key), top.get(key)) {
                text.insert(key.into(), v.clone());
            }
        }
        // transformers reads the top-level flag for the vision-language model.
        if let Some(v) = top.get("tie_word_embeddings") {
            text.insert("tie_word_embeddings".into(), v.clone());
        }
        let mut c = Self::from_value(Value::Object(text), &path.join("text_config"))?;
        c.language_model_prefix = true;
        Ok(c)
    }

    /// Whether layer `i` is a Gated DeltaNet layer.
    pub fn is_linear_attention(&self, i: usize) -> bool {
        self.layer_types.get(i) == Some(&LayerType::LinearAttention)
    }

    /// Whether layer `i`'s MLP is a sparse mixture of experts (Qwen3-MoE).
    pub fn is_sparse(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers.get(i) == Some(&true))
    }

    /// A fresh config of the given shape, with the fields transformers needs to load it.
    pub fn new_json(arch: Arch, shape: &ModelShape) -> Value {
        let mut v = serde_json::json!({
            "architectures": [arch.hf_class()],
            "model_type": arch.model_type(),
            "vocab_size": shape.vocab_size,
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": shape.rope_theta,
            "rope_scaling": null,
            "max_position_embeddings": shape.max_position_embeddings,
            "tie_word_embeddings": shape.tie_word_embeddings,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "use_cache": true,
            "torch_dtype": "float32",
        });
        if arch == Arch::Qwen2 {
            v["use_sliding_window"] = Value::Bool(false);
            v.as_object_mut().unwrap().remove("attention_bias");
        }
        if arch == Arch::Llama {
            v["mlp_bias"] = Value::Bool(false);
        }
        if arch == Arch::Qwen3_5 {
            // Every fourth layer full attention, the others DeltaNet layers with the attention's
            // head count and size (`oxrl init-model` takes them as options).
            let types: Vec<&str> = (0..shape.num_layers)
                .map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" })
                .collect();
            let o = v.as_object_mut().expect("an object");
            o.remove("rope_theta");
            o.remove("rope_scaling");
            o.insert("layer_types".into(), serde_json::json!(types));
            o.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_type": "default", "rope_theta": shape.rope_theta, "partial_rotary_factor": 0.25}),
            );
            o.insert("linear_num_key_heads".into(), shape.num_heads.into());
            o.insert("linear_num_value_heads".into(), shape.num_heads.into());
            o.insert("linear_key_head_dim".into(), shape.head_dim.into());
            o.insert("linear_value_head_dim".into(), shape.head_dim.into());
            o.insert("linear_conv_kernel_dim".into(), 4.into());
            o.insert("dtype".into(), "float32".into());
        }
        if arch == Arch::Gemma3 {
            // Gemma 3 1B's window and pattern (`oxrl init-model` takes them as options).
            super::gemma3::fresh_config(&mut v, shape.num_layers, 512, 6, 10_000.0);
        }
        if arch == Arch::Qwen3Moe {
            // 2 of 8 experts, each an eighth of the dense width (Qwen3-30B-A3B's expert width),
            // renormalised (`oxrl init-model` takes them as options).
            let o = v.as_object_mut().expect("an object");
            o.insert("num_experts".into(), 8.into());
            o.insert("num_experts_per_tok".into(), 2.into());
            o.insert("moe_intermediate_size".into(), shape.intermediate_size.div_ceil(8).into());
            o.insert("norm_topk_prob".into(), true.into());
            o.insert("decoder_sparse_step".into(), 1.into());
            o.insert("mlp_only_layers".into(), serde_json::json!([]));
            o.insert("router_aux_loss_coef".into(), 0.001.into());
            o.insert("output_router_logits".into(), false.into());
            o.insert("use_sliding_window".into(), false.into());
        }
        v
    }

    pub fn dir_path(dir: &Path) -> PathBuf {
        dir.join("config.json")
    }

    /// Number of query heads per key/value head.
    pub fn gqa_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// The free dimensions of a model, for `oxrl init-model`.
#[derive(Debug, Clone)]
pub struct ModelShape {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

/// `layer_types`: every layer full attention for the dense families (the only value they accept);
/// for Qwen3.5 the list, or by default every `full_attention_interval`-th layer (4) full
/// attention and the others DeltaNet layers, as transformers fills it in.
fn parse_layer_types(f: &JsonFields, arch: Arch, layers: usize) -> Result<Vec<LayerType>> {
    let Some(types) = f.get("layer_types") else {
        if arch != Arch::Qwen3_5 {
            return Ok(vec![LayerType::FullAttention; layers]);
        }
        let interval = f.opt_usize("full_attention_interval")?.unwrap_or(4);
        if interval == 0 {
            return Err(f.err("full_attention_interval", "must be positive"));
        }
        return Ok((0..layers)
            .map(|i| match (i + 1) % interval {
                0 => LayerType::FullAttention,
                _ => LayerType::LinearAttention,
            })
            .collect());
    };
    let types = types.as_array().ok_or_else(|| f.err("layer_types", "expected a list"))?;
    // The dense families only need every entry to be full attention (files may carry a longer
    // list than the layers they keep).
    if arch == Arch::Qwen3_5 && types.len() != layers {
        return Err(f.err("layer_types", format!("{} entries for num_hidden_layers = {layers}", types.len())));
    }
    let types: Vec<LayerType> = types
        .iter()
        .map(|t| match (t.as_str(), arch) {
            (Some("full_attention"), _) => Ok(LayerType::FullAttention),
            (Some("linear_attention"), Arch::Qwen3_5) => Ok(LayerType::LinearAttention),
            (Some("linear_attention"), _) => Err(f.err(
                "layer_types",
                format!(
                    "\"linear_attention\" layers are Qwen3.5's (model_type qwen3_5_text), not {}'s",
                    arch.model_type()
                ),
            )),
            _ => Err(f.err(
                "layer_types",
                format!("{t} layers are not supported (\"full_attention\", or \"linear_attention\" for Qwen3.5)"),
            )),
        })
        .collect::<Result<_>>()?;
    Ok(match arch {
        Arch::Qwen3_5 => types,
        _ => vec![LayerType::FullAttention; layers],
    })
}

/// A Qwen3-MoE config's experts, with transformers' defaults for missing fields. Layer i is sparse
/// unless listed in `mlp_only_layers`, when (i + 1) is a multiple of `decoder_sparse_step`.
fn parse_moe(f: &JsonFields, layers: usize) -> Result<MoeConfig> {
    let num_experts = match f.opt_usize("num_experts")? {
        Some(n) => n,
        None => f.opt_usize("num_local_experts")?.unwrap_or(128),
    };
    let k = f.opt_usize("num_experts_per_tok")?.unwrap_or(8);
    if k == 0 || k > num_experts {
        return Err(f.err("num_experts_per_tok", format!("{k} must be in 1..=num_experts ({num_experts})")));
    }
    let intermediate_size = f.opt_usize("moe_intermediate_size")?.unwrap_or(768);
    if intermediate_size == 0 {
        return Err(f.err("moe_intermediate_size", "must be positive"));
    }
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(f.err("decoder_sparse_step", "must be positive"));
    }
    let dense: Vec<usize> = match f.get("mlp_only_layers") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|i| i as usize)
                    .ok_or_else(|| f.err("mlp_only_layers", format!("expected layer indices, got {x}")))
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(f.err("mlp_only_layers", format!("expected a list, got {v}"))),
    };
    let coef = f.opt_f64("router_aux_loss_coef")?.unwrap_or(0.001);
    if !coef.is_finite() {
        return Err(f.err("router_aux_loss_coef", "must be finite"));
    }
    Ok(MoeConfig {
        num_experts,
        experts_per_token: k,
        intermediate_size,
        norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
        sparse_layers: (0..layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect(),
        router_aux_loss_coef: coef,
        output_router_logits: f.bool_or("output_router_logits", false)?,
    })
}

/// RoPE scaling from `rope_parameters` (transformers ≥ 5) or `rope_scaling` (older files).
fn parse_rope_scaling(f: &JsonFields) -> Result<RopeScaling> {
    let field = if f.get("rope_parameters").is_some() { "rope_parameters" } else { "rope_scaling" };
    let Some(v) = f.get(field) else { return Ok(RopeScaling::None) };
    parse_rope_object(f, field, v)
}

/// The scaling of one RoPE settings object `v` (the file's `field`).
pub(crate) fn parse_rope_object(f: &JsonFields, field: &str, v: &Value) -> Result<RopeScaling> {
    let m = v.as_object().ok_or_else(|| f.err(field, format!("expected an object or null, got {v}")))?;
    let kind = m.get("rope_type").or_else(|| m.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    let num = |key: &str| -> Result<f64> {
        m.get(key).and_then(|x| x.as_f64()).ok_or_else(|| f.err(&format!("{field}.{key}"), "missing or not a number"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        other => Err(f.err(
            &format!("{field}.rope_type"),
            format!("unsupported rope scaling `{other}` (supported: default, linear, llama3)"),
        )),
    }
}
