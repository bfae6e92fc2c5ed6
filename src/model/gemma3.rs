//! Gemma 3 text (`gemma3_text`): what its `config.json` says beyond the shared fields.
//!
//! A Gemma 3 block is a pre-norm block like the others, with two more norms (a "sandwich"):
//! ```text
//! h = h + post_attention_layernorm(attn(input_layernorm(h)))
//! h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
//! ```
//! Every RMSNorm (the q/k head norms too) scales by `1 + weight`; the MLP is GELU-tanh
//! (`gelu_pytorch_tanh`) gated; the embeddings are scaled by √hidden_size (rounded to the model's
//! dtype, as transformers rounds its scale buffer); attention scores by
//! `query_pre_attn_scalar^-1/2`. Layers are `sliding_attention` (keys within `sliding_window`
//! tokens, [`super::sliding_window`]) or `full_attention`, each with its own RoPE base: from
//! `rope_parameters.{sliding,full}_attention` (transformers ≥ 5) or `rope_local_base_freq` and
//! `rope_theta` (older files). Without `layer_types`, every `sliding_window_pattern`-th layer
//! (6) is global, as transformers fills it in. The LM head is tied by default.
//!
//! Refused by name: logit soft-capping (Gemma 2's, null in Gemma 3), bidirectional attention,
//! RoPE scaling on the sliding layers, and the vision-language `gemma3` layout.

use serde_json::Value;

use super::model_config::{parse_rope_object, LayerType, RopeScaling};
use crate::files::JsonFields;
use crate::Result;

/// Gemma 3's settings that the other families lack.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Settings {
    /// Each layer's attention: sliding or full.
    pub layer_types: Vec<LayerType>,
    /// Keys a sliding layer's query sees, itself included.
    pub sliding_window: usize,
    /// The RoPE base of the sliding layers (no scaling).
    pub local_rope_theta: f64,
    /// The RoPE base and scaling of the full-attention layers.
    pub global_rope_theta: f64,
    pub global_rope_scaling: RopeScaling,
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2`.
    pub query_pre_attn_scalar: f64,
}

/// The error for a `gemma3` (vision-language) config.
pub fn vision_language_refusal(f: &JsonFields) -> crate::Error {
    f.err(
        "model_type",
        "`gemma3` is Gemma 3's vision-language checkpoint, which is not supported: use a text \
         checkpoint (model_type gemma3_text, Gemma3ForCausalLM, as google/gemma-3-1b-*)",
    )
}

/// Reads Gemma 3's own fields of a `gemma3_text` config with `layers` layers.
pub fn parse(f: &JsonFields, layers: usize) -> Result<Gemma3Settings> {
    for field in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(v) = f.get(field) {
            return Err(f.err(field, format!("logit soft-capping ({v}) is not supported (Gemma 3 has none: null)")));
        }
    }
    if f.bool_or("use_bidirectional_attention", false)? {
        return Err(f.err("use_bidirectional_attention", "bidirectional attention is not supported"));
    }
    let sliding_window = f.opt_usize("sliding_window")?.unwrap_or(4096);
    if sliding_window == 0 {
        return Err(f.err("sliding_window", "must be positive"));
    }
    let query_pre_attn_scalar = f.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0);
    if query_pre_attn_scalar <= 0.0 {
        return Err(f.err("query_pre_attn_scalar", "must be positive"));
    }
    let (global_rope_theta, global_rope_scaling, local_rope_theta) = rope(f)?;
    Ok(Gemma3Settings {
        layer_types: layer_types(f, layers)?,
        sliding_window,
        local_rope_theta,
        global_rope_theta,
        global_rope_scaling,
        query_pre_attn_scalar,
    })
}

/// `layer_types`, or derived from `sliding_window_pattern` (also spelt `_sliding_window_pattern`).
fn layer_types(f: &JsonFields, layers: usize) -> Result<Vec<LayerType>> {
    let Some(types) = f.get("layer_types") else {
        let (field, pattern) = match f.opt_usize("sliding_window_pattern")? {
            Some(p) => ("sliding_window_pattern", p),
            None => ("_sliding_window_pattern", f.opt_usize("_sliding_window_pattern")?.unwrap_or(6)),
        };
        if pattern == 0 {
            return Err(f.err(field, "must be positive"));
        }
        return Ok((0..layers)
            .map(|i| match (i + 1) % pattern {
                0 => LayerType::FullAttention,
                _ => LayerType::SlidingAttention,
            })
            .collect());
    };
    let types = types.as_array().ok_or_else(|| f.err("layer_types", "expected a list"))?;
    if types.len() != layers {
        return Err(f.err("layer_types", format!("{} entries for num_hidden_layers = {layers}", types.len())));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(LayerType::FullAttention),
            Some("sliding_attention") => Ok(LayerType::SlidingAttention),
            _ => Err(f.err(
                "layer_types",
                format!("{t} layers are not Gemma 3's (\"sliding_attention\" or \"full_attention\")"),
            )),
        })
        .collect()
}

/// (global theta, global scaling, local theta), with transformers' defaults 10⁶ and 10⁴.
fn rope(f: &JsonFields) -> Result<(f64, RopeScaling, f64)> {
    let theta =
        |v: &Value, field: &str| -> Result<Option<f64>> {
            match v.get("rope_theta") {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_f64().filter(|t| t.is_finite() && *t > 0.0).map(Some).ok_or_else(|| {
                    f.err(&format!("{field}.rope_theta"), format!("expected a positive number, got {x}"))
                }),
            }
        };
    let params = f.get("rope_parameters");
    let per_type = |key: &str| params.and_then(|p| p.get(key)).filter(|v| !v.is_null());
    let (mut global, mut scaling) = (None, RopeScaling::None);
    if let Some(p) = per_type("full_attention") {
        let field = "rope_parameters.full_attention";
        global = theta(p, field)?;
        scaling = parse_rope_object(f, field, p)?;
    } else if let Some(p) = f.get("rope_scaling") {
        scaling = parse_rope_object(f, "rope_scaling", p)?;
    }
    let mut local = None;
    if let Some(p) = per_type("sliding_attention") {
        let field = "rope_parameters.sliding_attention";
        local = theta(p, field)?;
        if parse_rope_object(f, field, p)? != RopeScaling::None {
            return Err(f.err(field, "RoPE scaling on the sliding layers is not supported"));
        }
    }
    let global = match global {
        Some(t) => t,
        None => f.opt_f64("rope_theta")?.unwrap_or(1_000_000.0),
    };
    let local = match local {
        Some(t) => t,
        None => f.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0),
    };
    if global <= 0.0 || local <= 0.0 {
        return Err(f.err("rope_theta", "RoPE bases must be positive"));
    }
    Ok((global, scaling, local))
}

/// √hidden_size as transformers' scale buffer holds it (a float32 tensor) and multiplies by it
/// (cast to the weights' dtype): rounded to f32, then to `dtype`.
pub fn embed_scale(hidden_size: usize, dtype: candle_core::DType) -> Result<f64> {
    let s = (hidden_size as f64).sqrt() as f32 as f64;
    let t = candle_core::Tensor::new(&[s], &candle_core::Device::Cpu)?.to_dtype(dtype)?;
    Ok(t.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?[0])
}

impl super::model_config::ModelConfig {
    /// Whether layer `i` attends over a sliding window (Gemma 3's local layers).
    pub fn is_sliding(&self, i: usize) -> bool {
        self.layer_types.get(i) == Some(&LayerType::SlidingAttention)
    }

    /// The sliding layers' window, for a model that has any.
    pub fn sliding_window(&self) -> Option<usize> {
        let g = self.gemma3.as_ref()?;
        g.layer_types.contains(&LayerType::SlidingAttention).then_some(g.sliding_window)
    }

    /// The factor on attention scores: `query_pre_attn_scalar^-1/2` for Gemma 3, else
    /// `head_dim^-1/2`.
    pub fn attention_scale(&self) -> f64 {
        match &self.gemma3 {
            Some(g) => 1.0 / g.query_pre_attn_scalar.sqrt(),
            None => 1.0 / (self.head_dim as f64).sqrt(),
        }
    }
}

/// A Gemma 3 block's norms of its mixer's and its MLP's outputs (HF `post_attention_layernorm`
/// and `post_feedforward_layernorm`; the MLP's input norm, `pre_feedforward_layernorm`, is the
/// block's `post_attention_layernorm` field, the pre-MLP norm of the other families).
#[derive(Debug, Clone)]
pub struct PostNorms {
    pub attn: candle_core::Tensor,
    pub mlp: candle_core::Tensor,
}

/// The HF name of a block's pre-MLP norm.
pub fn pre_mlp_norm_name(cfg: &super::model_config::ModelConfig) -> &'static str {
    match cfg.gemma3 {
        Some(_) => "pre_feedforward_layernorm",
        None => "post_attention_layernorm",
    }
}

/// What a forward's sliding layers read: their RoPE tables, their attention bias over every
/// cached and new column, and how many trailing columns their caches keep afterwards.
pub struct LocalLayers {
    pub cos_sin: (candle_core::Tensor, candle_core::Tensor),
    /// [B, T, past + T].
    bias: candle_core::Tensor,
    /// Columns a later query can still see ([`super::sliding_window::needed_columns`]).
    pub keep: usize,
}

impl LocalLayers {
    /// For a model with sliding layers: `full_mask` covers the cached columns and the new ones.
    pub fn new(
        model: &super::transformer::Transformer,
        positions: &[Vec<u32>],
        full_mask: &[Vec<u8>],
        past: usize,
        t: usize,
    ) -> Result<Option<Self>> {
        let (Some(window), Some(rope)) = (model.config.sliding_window(), model.rope_local.as_ref()) else {
            return Ok(None);
        };
        let cos_sin = rope.tables(positions, model.compute_dtype())?;
        let bias = super::sliding_window::attention_bias(full_mask, past, t, window, &model.device)?;
        let keep = super::sliding_window::needed_columns(full_mask, window);
        Ok(Some(LocalLayers { cos_sin, bias, keep }))
    }

    /// The bias for a layer whose cache holds the last `cached` columns before this forward.
    pub fn bias(&self, cached: usize) -> Result<candle_core::Tensor> {
        let s = self.bias.dim(2)?;
        let t = self.bias.dim(1)?;
        Ok(self.bias.narrow(2, s - t - cached, cached + t)?)
    }
}

/// The sliding layers' RoPE: the config's with the local base and no scaling.
pub fn local_rope(
    cfg: &super::model_config::ModelConfig,
    device: &candle_core::Device,
) -> Result<Option<super::rope::Rope>> {
    let Some(g) = &cfg.gemma3 else { return Ok(None) };
    let mut local = cfg.clone();
    local.rope_theta = g.local_rope_theta;
    local.rope_scaling = RopeScaling::None;
    Ok(Some(super::rope::Rope::new(&local, device)?))
}

/// Turns a fresh config (`ModelConfig::new_json`) into Gemma 3's: every `pattern`-th layer of
/// `layers` global, the others sliding over `window` tokens; the global RoPE base the config's
/// `rope_theta`, the local one `local_theta`; scores scaled by `head_dim^-1/2`
/// (`query_pre_attn_scalar = head_dim`, as Gemma 3 1B has it); a tied head.
pub fn fresh_config(v: &mut Value, layers: usize, window: usize, pattern: usize, local_theta: f64) {
    let o = v.as_object_mut().expect("a config object");
    let global = o.remove("rope_theta").unwrap_or(Value::from(1_000_000.0));
    o.remove("rope_scaling");
    o.remove("hidden_act");
    let head_dim = o.get("head_dim").cloned().unwrap_or(Value::from(256));
    let types: Vec<&str> = (0..layers)
        .map(|i| if (i + 1) % pattern.max(1) == 0 { "full_attention" } else { "sliding_attention" })
        .collect();
    let fields = serde_json::json!({
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": window,
        "query_pre_attn_scalar": head_dim,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": global},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "attn_logit_softcapping": null,
        "final_logit_softcapping": null,
        "use_bidirectional_attention": false,
        "tie_word_embeddings": true,
        "dtype": "float32",
    });
    for (k, x) in fields.as_object().expect("an object") {
        o.insert(k.clone(), x.clone());
    }
}
