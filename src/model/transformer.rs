//! The decoder-only transformer shared by Llama, Qwen2, Qwen3 and Qwen3.5.
//!
//! ```text
//! h = embed(tokens)
//! for each block:  h = h + o_proj(attn(rope(q), rope(k), v))   with q,k,v from rms_norm(h)
//!                  h = h + down(silu(gate(x)) * up(x))          with x = rms_norm(h)
//! logits = lm_head(rms_norm(h))                                (lm_head = embed when tied)
//! ```
//! Qwen3.5's blocks mix tokens either with a Gated DeltaNet ([`super::delta_net`]: a recurrent
//! state per row, carried in the cache instead of keys and values) or with gated attention
//! (`attn ⊙ σ(gate)` before o_proj, the gate from a doubled q_proj; RoPE on the first
//! `rotary_dim` of each head); its RMSNorms scale by `1 + weight`.
//! Gemma 3's blocks ([`super::gemma3`]) norm the mixer's and the MLP's outputs too (before the
//! residual adds), gate the MLP with GELU-tanh, scale the embeddings by √hidden and attend, on
//! their sliding layers, over a window with their own RoPE base; a cache keeps only the window
//! for those layers ([`super::sliding_window`]).
//! Attention is causal and masks padded keys (left or right padding), with per-row position ids.
//! Grouped-query attention is computed without copying keys/values: the query heads that share a
//! key/value head are folded into the row dimension of one matmul. Softmax and RMSNorm run in
//! f32 whatever the run dtype, as in transformers.
//!
//! One forward serves training and decoding: with a [`KvCache`] the new tokens attend to the
//! cached positions too, so prefill + one-token steps give the same logits as the full forward.
//! Everything is built from differentiable candle primitives: gradients reach every parameter.
//! The one exception is a cached forward's attention over a few new tokens (decoding): a fused
//! op without a backward ([`ops::cached_attention`]); nothing trains through a cached forward.

use candle_core::{DType, Device, Tensor, Var, D};

use super::delta_net::GatedDeltaNet;
use super::kv_cache::KvCache;
use super::linear::Linear;
use super::model_config::ModelConfig;
use super::moe::SparseMoe;
use super::named_tensors::NamedTensors;
use super::ops;
use super::rope::Rope;
use super::row_adapters::RowAdapters;
use super::weights;
use crate::files::write_json;
use crate::{Error, Result};

/// A large negative bias for masked attention scores; finite so that no NaN can appear.
pub(crate) const MASKED: f32 = -1e30;

#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Qwen3 only: RMSNorm weights over head_dim.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// q_proj gives [q | gate] per head, and the output is gated (Qwen3.5).
    pub output_gate: bool,
    /// Attends over a sliding window (Gemma 3's local layers: their own RoPE base and mask).
    pub sliding: bool,
}

/// A block's token mixer.
#[derive(Debug, Clone)]
pub enum Mixer {
    Attention(Attention),
    DeltaNet(GatedDeltaNet),
}

#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// A block's MLP: dense, or a sparse mixture of experts (Qwen3-MoE).
#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

#[derive(Debug, Clone)]
pub struct Block {
    pub input_layernorm: Tensor,
    pub mixer: Mixer,
    pub post_attention_layernorm: Tensor,
    pub mlp: FeedForward,
    /// Gemma 3's norms of the mixer's and the MLP's outputs.
    pub post_norms: Option<super::gemma3::PostNorms>,
}

/// What every block of a training forward reads besides its input: the RoPE tables, the
/// attention bias, the sliding layers' own (Gemma 3) and the key mask.
pub(crate) struct BlockInputs {
    cos_sin: (Tensor, Tensor),
    bias: Tensor,
    local: Option<super::gemma3::LocalLayers>,
    mask: Vec<Vec<u8>>,
}

#[derive(Debug, Clone)]
pub struct Transformer {
    pub config: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<Block>,
    pub norm: Tensor,
    /// Its weight is `embed_tokens` when the embeddings are tied.
    pub lm_head: Linear,
    pub rope: Rope,
    /// The sliding layers' RoPE (Gemma 3's local base).
    pub rope_local: Option<Rope>,
    pub dtype: DType,
    pub device: Device,
    /// Set when the weights are sharded across data-parallel ranks: the training forward and
    /// backward gather each unit before reading it ([`super::sharded_weights`]).
    pub weight_gate: Option<super::sharded_weights::WeightGate>,
}

/// RMSNorm over the last dimension, computed in f32 (f64 for f64): x / sqrt(mean(x²) + eps) · w.
/// Fused on the CPU for f32/f64 (`ops::rms_norm`). The weight is widened to x's dtype when they
/// differ (a bf16 model computing in f32, [`Transformer::compute_dtype`]).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if weight.dtype() != x.dtype() {
        return ops::rms_norm::rms_norm(x, &weight.to_dtype(x.dtype())?, eps);
    }
    ops::rms_norm::rms_norm(x, weight, eps)
}

/// The weight an RMSNorm scales by: `1 + w` in x's dtype for Qwen3.5 (as transformers, in
/// f32), else w itself.
pub fn norm_weight(w: &Tensor, cfg: &ModelConfig, dtype: DType) -> Result<Tensor> {
    match cfg.norm_unit_offset {
        true => Ok((w.to_dtype(dtype)? + 1.0)?),
        false => Ok(w.clone()),
    }
}

/// [`rms_norm`] with the model's norm weight ([`norm_weight`]).
pub fn model_norm(x: &Tensor, w: &Tensor, cfg: &ModelConfig) -> Result<Tensor> {
    rms_norm(x, &norm_weight(w, cfg, x.dtype())?, cfg.rms_norm_eps)
}

/// (h + a, [`model_norm`] of it): one kernel where nothing is differentiated on CUDA
/// (`ops::rms_norm::add_rms_norm`), the add and the norm otherwise; the same bits either way.
fn add_model_norm(h: &Tensor, a: &Tensor, w: &Tensor, cfg: &ModelConfig) -> Result<(Tensor, Tensor)> {
    let w = norm_weight(w, cfg, h.dtype())?;
    let w = if w.dtype() != h.dtype() { w.to_dtype(h.dtype())? } else { w };
    ops::rms_norm::add_rms_norm(h, a, &w, cfg.rms_norm_eps)
}

/// Rotates the first `rotary_dim` channels of y [B, H, T, D] and passes the rest (all of them
/// rotate unless the config says otherwise); contiguous.
fn rotate(y: &Tensor, cfg: &ModelConfig, cos_sin: &(Tensor, Tensor)) -> Result<Tensor> {
    let (d, rd) = (cfg.head_dim, cfg.rotary_dim);
    if rd == d {
        return ops::rope::rope(y, &cos_sin.0, &cos_sin.1);
    }
    let rot = ops::rope::rope(&y.narrow(D::Minus1, 0, rd)?, &cos_sin.0, &cos_sin.1)?;
    Ok(Tensor::cat(&[rot, y.narrow(D::Minus1, rd, d - rd)?.contiguous()?], D::Minus1)?.contiguous()?)
}

/// Softmax over the last dimension with the max subtracted first (detached: it cancels).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Additive attention bias [B, T, S]: query i (at cache offset `past`) sees key j iff
/// j ≤ past + i and key j is real. A query always sees itself, so that padded queries (whose
/// outputs are discarded) never have an empty row.
pub fn attention_bias(key_mask: &[Vec<u8>], past: usize, t: usize, device: &Device) -> Result<Tensor> {
    if !device.is_cpu() {
        return attention_bias_on_device(key_mask, past, t, device);
    }
    let b = key_mask.len();
    let s = past + t;
    let mut bias = vec![0f32; b * t * s];
    for (row, mask) in key_mask.iter().enumerate() {
        for i in 0..t {
            let q = past + i;
            let out = &mut bias[(row * t + i) * s..(row * t + i + 1) * s];
            for (j, slot) in out.iter_mut().enumerate() {
                let visible = j == q || (j < q && mask[j] != 0);
                if !visible {
                    *slot = MASKED;
                }
            }
        }
    }
    Ok(Tensor::from_vec(bias, (b, t, s), device)?)
}

/// [`attention_bias`] built where it is used, from the key mask alone (B × S bytes cross to the
/// device, not the B × T × S floats of a bias built on the host): the same values.
fn attention_bias_on_device(key_mask: &[Vec<u8>], past: usize, t: usize, device: &Device) -> Result<Tensor> {
    let (b, s) = (key_mask.len(), past + t);
    if let Some(bad) = key_mask.iter().find(|m| m.len() != s) {
        return Err(Error::input(format!("attention bias: a key mask of {} entries for {s} keys", bad.len())));
    }
    let keys = Tensor::from_vec(key_mask.concat(), (b, 1, s), device)?.ne(0u8)?;
    let queries = Tensor::arange(past as u32, s as u32, device)?.reshape((1, t, 1))?;
    let columns = Tensor::arange(0u32, s as u32, device)?.reshape((1, 1, s))?;
    // Key j is visible to query q when j == q, or j < q and key j is real.
    let earlier = columns.broadcast_lt(&queries)?.broadcast_mul(&keys)?;
    let visible = earlier.broadcast_maximum(&columns.broadcast_eq(&queries)?)?;
    let zeros = Tensor::zeros((b, t, s), DType::F32, device)?;
    let masked = Tensor::full(MASKED, (b, t, s), device)?;
    Ok(visible.where_cond(&zeros, &masked)?)
}

impl Attention {
    /// The projections of x [B, T, hidden] into heads: (q, k, v) [B, heads, T, d], q and k
    /// normalised (Qwen3) and rotated, and the output gate [B, T, heads·d] (Qwen3.5); q and the
    /// gate are None when `queries` is false.
    #[allow(clippy::type_complexity)]
    fn project(
        &self,
        x: &Tensor,
        cfg: &ModelConfig,
        cos_sin: &(Tensor, Tensor),
        adapters: Option<(&RowAdapters, usize)>,
        queries: bool,
    ) -> Result<(Option<(Tensor, Option<Tensor>)>, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (ad, first) = (adapters.map(|a| a.0), adapters.map_or(0, |a| a.1));
        let proj = |lin: &Linear, k: usize| RowAdapters::forward(ad, lin, x, first + k);
        let (h, kvh, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let heads = |y: Tensor, n: usize| -> Result<Tensor> { Ok(y.reshape((b, t, n, d))?.transpose(1, 2)?) };
        // A step that differentiates nothing, with no norms, gate or adapters (decoding and
        // prefills of Qwen2 / Llama shapes): q's and k's biases and rotations in one kernel on
        // CUDA (`ops::rope::rope_pair`; the same bits as the bias adds and rotations).
        let plain = queries
            && !self.output_gate
            && self.q_norm.is_none()
            && self.k_norm.is_none()
            && cfg.rotary_dim == d
            && adapters.is_none()
            && self.q_proj.lora.is_none()
            && self.k_proj.lora.is_none()
            && x.device().is_cuda()
            && !x.track_op()
            && !self.q_proj.weight.track_op()
            && !self.k_proj.weight.track_op();
        if plain {
            let bias = |lin: &Linear| lin.bias.as_ref().map(|b| b.to_dtype(x.dtype())).transpose();
            let (q, k) = ops::rope::rope_pair(
                &self.q_proj.product(x)?,
                bias(&self.q_proj)?.as_ref(),
                &self.k_proj.product(x)?,
                bias(&self.k_proj)?.as_ref(),
                (h, kvh),
                &cos_sin.0,
                &cos_sin.1,
            )?;
            let v = heads(proj(&self.v_proj, 2)?, kvh)?.contiguous()?;
            return Ok((Some((q, None)), k, v));
        }
        // Normalised in the [B, T, heads, d] layout the projection wrote (no copy), then rotated
        // and made contiguous in [B, heads, T, d] in one pass.
        let normed_rotated = |y: Tensor, norm: &Option<Tensor>| -> Result<Tensor> {
            let y = match norm {
                Some(w) => model_norm(&y.transpose(1, 2)?, w, cfg)?.transpose(1, 2)?,
                None => y,
            };
            rotate(&y, cfg, cos_sin)
        };
        let q = match (queries, self.output_gate) {
            (false, _) => None,
            (true, false) => Some((normed_rotated(heads(proj(&self.q_proj, 0)?, h)?, &self.q_norm)?, None)),
            (true, true) => {
                // Per head [q | gate], d each.
                let qg = proj(&self.q_proj, 0)?.reshape((b, t, h, 2 * d))?;
                let q = qg.narrow(3, 0, d)?.transpose(1, 2)?;
                let gate = qg.narrow(3, d, d)?.contiguous()?.reshape((b, t, h * d))?;
                Some((normed_rotated(q, &self.q_norm)?, Some(gate)))
            }
        };
        let k = normed_rotated(heads(proj(&self.k_proj, 1)?, kvh)?, &self.k_norm)?;
        let v = heads(proj(&self.v_proj, 2)?, kvh)?.contiguous()?;
        Ok((q, k, v))
    }

    fn forward(
        &self,
        x: &Tensor,
        cfg: &ModelConfig,
        cos_sin: &(Tensor, Tensor),
        bias: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
        adapters: Option<(&RowAdapters, usize)>,
    ) -> Result<Tensor> {
        let (q, k, v) = self.project(x, cfg, cos_sin, adapters, true)?;
        let (q, gate) = q.expect("queries were asked for");
        let cached = cache.is_some();
        let (k, v) = match cache {
            Some((c, layer)) => c.append(layer, &k, &v)?,
            None => (k, v),
        };
        let scale = cfg.attention_scale();
        // [B, T, h·d]. A cached forward (decode steps and prefills of any length) takes the
        // fused op, which reads the cache's views in place and sums in the order the trainer's
        // forward does; everything else (uncached forwards off the tape, CUDA) the
        // candle path: the `rep` query heads sharing a kv head folded into the rows of one
        // batched matmul, softmax in f32, as one graph node when it is differentiated.
        let out = if cached && ops::fused(&q) {
            ops::cached_attention::cached_attention(&q, &k, &v, bias, scale)?
        } else {
            ops::attention::attention(&q, &k, &v, bias, scale)?
        };
        let out = match gate {
            Some(g) => super::attention_gate::apply(&out, &g)?,
            None => out,
        };
        let (ad, first) = (adapters.map(|a| a.0), adapters.map_or(0, |a| a.1));
        RowAdapters::forward(ad, &self.o_proj, &out, first + 3)
    }
}

impl Mlp {
    /// `adapters` with the index of gate_proj (up and down follow); the gate's activation is
    /// GELU-tanh (Gemma) when `gelu`, else SiLU.
    fn forward(&self, x: &Tensor, adapters: Option<(&RowAdapters, usize)>, gelu: bool) -> Result<Tensor> {
        let (ad, first) = (adapters.map(|a| a.0), adapters.map_or(0, |a| a.1));
        let proj = |lin: &Linear, k: usize, x: &Tensor| RowAdapters::forward(ad, lin, x, first + k);
        let gate = proj(&self.gate_proj, 0, x)?;
        let up = proj(&self.up_proj, 1, x)?;
        let act = match gelu {
            true => ops::gelu_tanh::gelu_tanh_mul(&gate, &up)?,
            false => ops::swiglu::swiglu(&gate, &up)?,
        };
        proj(&self.down_proj, 2, &act)
    }
}

fn linear(
    source: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    name: &str,
    out: usize,
    inp: usize,
    bias: bool,
) -> Result<Linear> {
    let w = source(&format!("{name}.weight"), &[out, inp])?;
    let b = if bias { Some(source(&format!("{name}.bias"), &[out])?) } else { None };
    Ok(Linear::new(w, b))
}

impl Transformer {
    /// The dtype activations are computed in: the weights' dtype, except for bf16 and f16 weights
    /// on the CPU, which are widened to f32 as they are read — as the trainer's tape does, so that
    /// an engine's log-probs are the trainer's bits, and bf16 decoding reads half the
    /// bytes of f32 without computing in bf16.
    pub fn compute_dtype(&self) -> DType {
        match (self.device.is_cpu(), self.dtype) {
            (true, DType::BF16 | DType::F16) => DType::F32,
            (_, d) => d,
        }
    }

    /// Loads `DIR/config.json` and the weights, in `dtype` on `device`.
    pub fn load(dir: &std::path::Path, dtype: DType, device: &Device) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let mut w = NamedTensors::load_dir(dir, device)?;
        // A vision-language checkpoint keeps the language model under model.language_model.
        let prefixed = config.language_model_prefix;
        let m = Self::build(config, dtype, device, &mut |name, shape| match name.strip_prefix("model.") {
            Some(rest) if prefixed => w.take(&format!("model.language_model.{rest}"), shape, dtype),
            _ => w.take(name, shape, dtype),
        })?;
        // Left over tensors are a sign of a mismatched config; only buffers that transformers
        // itself ignores are allowed, and for Qwen3.5 the vision tower and the multi-token
        // prediction head, which text training leaves aside.
        let tied = m.config.tie_word_embeddings;
        let qwen3_5 = m.config.arch == super::model_config::Arch::Qwen3_5;
        let mtp = std::cell::Cell::new(false);
        w.reject_leftovers(
            |name| {
                mtp.set(mtp.get() || (qwen3_5 && name.starts_with("mtp.")));
                let aside = qwen3_5 && (name.starts_with("model.visual.") || name.starts_with("mtp."));
                aside || name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
            },
            "not part of this model's config",
        )?;
        if mtp.get() {
            eprintln!("note: {}: the multi-token prediction head (mtp.*) is not used", dir.display());
        }
        Ok(m)
    }

    /// Builds the model, asking `source` for each parameter by HF name and shape.
    pub fn build(
        config: ModelConfig,
        dtype: DType,
        device: &Device,
        source: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        let c = &config;
        let (hd, h, kvh, d, im) =
            (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size);
        let embed_tokens = source("model.embed_tokens.weight", &[c.vocab_size, hd])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        let q_out = if c.attn_output_gate { 2 * h * d } else { h * d };
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mut lin =
                |name: &str, out: usize, inp: usize, bias: bool| linear(source, &format!("{p}.{name}"), out, inp, bias);
            let mixer = match (c.is_linear_attention(i), c.delta_net) {
                (true, Some(dn)) => {
                    let (cd, vd, nv) = (dn.conv_dim(), dn.value_dim(), dn.num_value_heads);
                    let in_proj_qkv = lin("linear_attn.in_proj_qkv", cd, hd, false)?;
                    let in_proj_z = lin("linear_attn.in_proj_z", vd, hd, false)?;
                    let in_proj_b = lin("linear_attn.in_proj_b", nv, hd, false)?;
                    let in_proj_a = lin("linear_attn.in_proj_a", nv, hd, false)?;
                    let out_proj = lin("linear_attn.out_proj", hd, vd, false)?;
                    let q = format!("{p}.linear_attn");
                    Mixer::DeltaNet(GatedDeltaNet {
                        in_proj_qkv,
                        in_proj_z,
                        in_proj_b,
                        in_proj_a,
                        out_proj,
                        conv1d: source(&format!("{q}.conv1d.weight"), &[cd, 1, dn.conv_kernel])?,
                        a_log: source(&format!("{q}.A_log"), &[nv])?,
                        dt_bias: source(&format!("{q}.dt_bias"), &[nv])?,
                        norm: source(&format!("{q}.norm.weight"), &[dn.value_head_dim])?,
                    })
                }
                _ => {
                    let mut self_attn = Attention {
                        q_proj: lin("self_attn.q_proj", q_out, hd, c.qkv_bias)?,
                        k_proj: lin("self_attn.k_proj", kvh * d, hd, c.qkv_bias)?,
                        v_proj: lin("self_attn.v_proj", kvh * d, hd, c.qkv_bias)?,
                        o_proj: lin("self_attn.o_proj", hd, h * d, c.o_bias)?,
                        q_norm: None,
                        k_norm: None,
                        output_gate: c.attn_output_gate,
                        sliding: c.is_sliding(i),
                    };
                    if c.qk_norm {
                        self_attn.q_norm = Some(source(&format!("{p}.self_attn.q_norm.weight"), &[d])?);
                        self_attn.k_norm = Some(source(&format!("{p}.self_attn.k_norm.weight"), &[d])?);
                    }
                    Mixer::Attention(self_attn)
                }
            };
            let mut lin =
                |name: &str, out: usize, inp: usize, bias: bool| linear(source, &format!("{p}.{name}"), out, inp, bias);
            let mlp = match &c.moe {
                Some(moe) if c.is_sparse(i) => {
                    let mi = moe.intermediate_size;
                    let experts = (0..moe.num_experts)
                        .map(|e| {
                            Ok(Mlp {
                                gate_proj: lin(&format!("mlp.experts.{e}.gate_proj"), mi, hd, false)?,
                                up_proj: lin(&format!("mlp.experts.{e}.up_proj"), mi, hd, false)?,
                                down_proj: lin(&format!("mlp.experts.{e}.down_proj"), hd, mi, false)?,
                            })
                        })
                        .collect::<Result<_>>()?;
                    FeedForward::Sparse(SparseMoe {
                        router: lin("mlp.gate", moe.num_experts, hd, false)?,
                        experts,
                        top_k: moe.experts_per_token,
                        norm_topk_prob: moe.norm_topk_prob,
                        log: None,
                    })
                }
                _ => FeedForward::Dense(Mlp {
                    gate_proj: lin("mlp.gate_proj", im, hd, c.mlp_bias)?,
                    up_proj: lin("mlp.up_proj", im, hd, c.mlp_bias)?,
                    down_proj: lin("mlp.down_proj", hd, im, c.mlp_bias)?,
                }),
            };
            let pre_mlp = super::gemma3::pre_mlp_norm_name(c);
            let input_layernorm = source(&format!("{p}.input_layernorm.weight"), &[hd])?;
            let post_attention_layernorm = source(&format!("{p}.{pre_mlp}.weight"), &[hd])?;
            let post_norms = match c.gemma3 {
                Some(_) => Some(super::gemma3::PostNorms {
                    attn: source(&format!("{p}.post_attention_layernorm.weight"), &[hd])?,
                    mlp: source(&format!("{p}.post_feedforward_layernorm.weight"), &[hd])?,
                }),
                None => None,
            };
            layers.push(Block { input_layernorm, mixer, post_attention_layernorm, mlp, post_norms });
        }
        let norm = source("model.norm.weight", &[hd])?;
        let lm_head = if c.tie_word_embeddings {
            Linear::new(embed_tokens.clone(), None)
        } else {
            Linear::new(source("lm_head.weight", &[c.vocab_size, hd])?, None)
        };
        let rope = Rope::new(c, device)?;
        let rope_local = super::gemma3::local_rope(c, device)?;
        Ok(Transformer {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            rope_local,
            dtype,
            device: device.clone(),
            weight_gate: None,
        })
    }

    /// Visits every base parameter with its HF name (the tied lm_head is not listed twice).
    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        f("model.embed_tokens.weight", &mut self.embed_tokens)?;
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            f(&format!("{p}.input_layernorm.weight"), &mut l.input_layernorm)?;
            for (name, lin) in l.linears_mut() {
                f(&format!("{p}.{name}.weight"), &mut lin.weight)?;
                if let Some(b) = lin.bias.as_mut() {
                    f(&format!("{p}.{name}.bias"), b)?;
                }
            }
            match &mut l.mixer {
                Mixer::Attention(a) => {
                    if let Some(w) = a.q_norm.as_mut() {
                        f(&format!("{p}.self_attn.q_norm.weight"), w)?;
                    }
                    if let Some(w) = a.k_norm.as_mut() {
                        f(&format!("{p}.self_attn.k_norm.weight"), w)?;
                    }
                }
                Mixer::DeltaNet(dn) => {
                    f(&format!("{p}.linear_attn.conv1d.weight"), &mut dn.conv1d)?;
                    f(&format!("{p}.linear_attn.A_log"), &mut dn.a_log)?;
                    f(&format!("{p}.linear_attn.dt_bias"), &mut dn.dt_bias)?;
                    f(&format!("{p}.linear_attn.norm.weight"), &mut dn.norm)?;
                }
            }
            // The router and the experts are not LoRA targets (not among the projections).
            if let FeedForward::Sparse(moe) = &mut l.mlp {
                f(&format!("{p}.mlp.gate.weight"), &mut moe.router.weight)?;
                for (e, x) in moe.experts.iter_mut().enumerate() {
                    for (name, lin) in
                        [("gate_proj", &mut x.gate_proj), ("up_proj", &mut x.up_proj), ("down_proj", &mut x.down_proj)]
                    {
                        f(&format!("{p}.mlp.experts.{e}.{name}.weight"), &mut lin.weight)?;
                    }
                }
            }
            let pre_mlp = super::gemma3::pre_mlp_norm_name(&self.config);
            f(&format!("{p}.{pre_mlp}.weight"), &mut l.post_attention_layernorm)?;
            if let Some(n) = l.post_norms.as_mut() {
                f(&format!("{p}.post_attention_layernorm.weight"), &mut n.attn)?;
                f(&format!("{p}.post_feedforward_layernorm.weight"), &mut n.mlp)?;
            }
        }
        f("model.norm.weight", &mut self.norm)?;
        if self.config.tie_word_embeddings {
            self.lm_head.weight = self.embed_tokens.clone();
        } else {
            f("lm_head.weight", &mut self.lm_head.weight)?;
        }
        Ok(())
    }

    /// The index of layer `layer`'s first projection (the number of projections before it); of
    /// lm_head for `layer` = the number of layers.
    pub fn first_linear(&self, layer: usize) -> usize {
        self.layers[..layer].iter().map(Block::num_linears).sum()
    }

    /// Every base parameter by HF name, sorted by name.
    pub fn named_params(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![];
        let mut copy = self.clone();
        copy.visit_params_mut(&mut |name, t| {
            out.push((name.to_string(), t.clone()));
            Ok(())
        })
        .expect("collecting parameters cannot fail");
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every projection of the model by module name (`model.layers.0.self_attn.q_proj`, `lm_head`).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = vec![];
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (name, lin) in l.linears_mut() {
                out.push((format!("model.layers.{i}.{name}"), lin));
            }
        }
        out.push(("lm_head".to_string(), &mut self.lm_head));
        out
    }

    /// This model with every tensor that belongs to an autograd graph (a trainable parameter or
    /// adapter) copied into storage of its own, detached; the rest is shared. What a sampling
    /// engine holds: a trainer's in-place optimizer steps must not reach it (its weights change
    /// only by versioned updates), and a forward over variables would build an autograd graph at
    /// every decode step.
    pub fn without_variables(&self) -> Result<Transformer> {
        let mut m = self.clone();
        m.visit_params_mut(&mut |_, t| {
            *t = super::linear::owned(t)?;
            Ok(())
        })?;
        for (_, lin) in m.linears_mut() {
            if let Some(l) = lin.lora.as_mut() {
                *l = l.owned()?;
            }
        }
        Ok(m)
    }

    /// Turns every base parameter into a trainable variable and returns them by HF name.
    pub fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        self.check_trainable()?;
        let mut vars = vec![];
        self.visit_params_mut(&mut |name, t| {
            let var = Var::from_tensor(t)?;
            *t = var.as_tensor().clone();
            vars.push((name.to_string(), var));
            Ok(())
        })?;
        Ok(vars)
    }

    pub fn num_params(&self) -> usize {
        self.named_params().iter().map(|(_, t)| t.elem_count()).sum()
    }

    /// Final hidden states [B, T, hidden] for `input_ids` [B, T] at `positions` [B, T] with the
    /// key mask `mask` \[B\]\[T\] (1 = real token). With a cache, the tokens are appended after the
    /// cached ones and attend to them.
    pub fn forward_hidden(
        &self,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.forward_hidden_adapted(input_ids, positions, mask, cache, None)
    }

    /// [`Transformer::forward_hidden`] with per-row LoRA adapters (see [`RowAdapters`]).
    pub fn forward_hidden_adapted(
        &self,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        cache: Option<&mut KvCache>,
        adapters: Option<&RowAdapters>,
    ) -> Result<Tensor> {
        let hidden = self.run(input_ids, positions, mask, cache, adapters, true)?;
        Ok(hidden.expect("hidden states were asked for"))
    }

    /// Appends the keys and values of `input_ids` to `cache` without the final hidden states:
    /// the last block stops after its key and value projections, since its queries, attention,
    /// o_proj and MLP only feed hidden states (a layer's worth of a prefill's FLOPs). For a
    /// prompt prefill that scores nothing.
    pub fn fill_cache_adapted(
        &self,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        cache: &mut KvCache,
        adapters: Option<&RowAdapters>,
    ) -> Result<()> {
        self.run(input_ids, positions, mask, Some(cache), adapters, false).map(drop)
    }

    /// The forward of [`Transformer::forward_hidden_adapted`]; without `hidden`, the cache is
    /// filled and the last block's remaining work skipped ([`Transformer::fill_cache_adapted`]).
    fn run(
        &self,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        mut cache: Option<&mut KvCache>,
        adapters: Option<&RowAdapters>,
        hidden: bool,
    ) -> Result<Option<Tensor>> {
        self.check_whole("the graph forward")?;
        let (b, t) = self.check_inputs(input_ids, positions, mask)?;
        if let Some(c) = cache.as_ref() {
            if c.seq_len() > 0 && c.key_mask().len() != b {
                return Err(Error::input(format!("cache holds {} rows, batch has {b}", c.key_mask().len())));
            }
        }
        let dev = &self.device;
        let cos_sin = self.rope.tables(positions, self.compute_dtype())?;

        let past = cache.as_ref().map_or(0, |c| c.seq_len());
        let full_mask: Vec<Vec<u8>> = match cache.as_ref() {
            Some(c) if past > 0 => c.key_mask().iter().zip(mask).map(|(a, m)| [a.as_slice(), m].concat()).collect(),
            _ => mask.to_vec(),
        };
        let bias = attention_bias(&full_mask, past, t, dev)?;
        // A cached forward's attention takes the bias in the queries' dtype: cast once, not in
        // every layer.
        let bias = if cache.is_some() { bias.to_dtype(self.compute_dtype())? } else { bias };
        let local = super::gemma3::LocalLayers::new(self, positions, &full_mask, past, t)?;
        if let Some(c) = cache.as_deref_mut() {
            c.extend_mask(mask);
        }

        let mut h = self.embed(input_ids)?;
        let cfg = &self.config;
        let last = self.layers.len().saturating_sub(1);
        let mut first = 0;
        // The next block's normed input, when the previous block computed it with its sum.
        let mut normed = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let x = match normed.take() {
                Some(x) => x,
                None => model_norm(&h, &layer.input_layernorm, cfg)?,
            };
            let mlp_adapters = adapters.map(|a| (a, first + layer.num_linears() - 3));
            let adapters = adapters.map(|a| (a, first));
            first += layer.num_linears();
            let a = match &layer.mixer {
                Mixer::Attention(attn) => {
                    // A sliding layer: its tables, its bias over the columns its cache holds,
                    // and its cache cut to what later queries see.
                    let local = local.as_ref().filter(|_| attn.sliding);
                    let cos_sin = local.map_or(&cos_sin, |l| &l.cos_sin);
                    let bias = match local {
                        Some(l) => l.bias(cache.as_ref().and_then(|c| c.layer(i)).map_or(Ok(0), |kv| kv.0.dim(2))?)?,
                        None => bias.clone(),
                    };
                    let trim = |c: &mut KvCache| local.map_or(Ok(()), |l| c.keep_last(i, l.keep));
                    if let (false, true, Some(c)) = (hidden, i == last, cache.as_deref_mut()) {
                        let (_, k, v) = attn.project(&x, cfg, cos_sin, adapters, false)?;
                        c.append(i, &k, &v)?;
                        trim(c)?;
                        return Ok(None);
                    }
                    let a = attn.forward(&x, cfg, cos_sin, &bias, cache.as_deref_mut().map(|c| (c, i)), adapters)?;
                    cache.as_deref_mut().map_or(Ok(()), trim)?;
                    a
                }
                Mixer::DeltaNet(dn) => {
                    let dnc = cfg.delta_net.as_ref().expect("a DeltaNet layer has its config");
                    let state = cache.as_deref_mut().map(|c| c.state_mut(i));
                    let a = dn.forward(&x, dnc, cfg.rms_norm_eps, mask, state, adapters)?;
                    if !hidden && i == last {
                        return Ok(None);
                    }
                    a
                }
            };
            let next = match self.layers.get(i + 1) {
                Some(next) => Some(&next.input_layernorm),
                None => hidden.then_some(&self.norm),
            };
            (h, normed) = self.finish_block(layer, h, a, mlp_adapters, next)?;
        }
        match normed {
            Some(x) => Ok(Some(x)),
            None => hidden.then(|| model_norm(&h, &self.norm, cfg)).transpose(),
        }
    }

    /// The embeddings [B, T, hidden] of `input_ids` [B, T] (rows of equal length), in the
    /// compute dtype (Gemma's scaled).
    pub(crate) fn embed(&self, input_ids: &[Vec<u32>]) -> Result<Tensor> {
        let (b, t) = (input_ids.len(), input_ids.first().map_or(0, Vec::len));
        let mut h = super::ops::embedding::embedding(&self.embed_tokens, &input_ids.concat())?.reshape((b, t, ()))?;
        if h.dtype() != self.compute_dtype() {
            h = h.to_dtype(self.compute_dtype())?;
        }
        if self.config.gemma3.is_some() {
            h = (h * super::gemma3::embed_scale(self.config.hidden_size, self.dtype)?)?;
        }
        Ok(h)
    }

    /// A block's second half from its input `h` and its mixer's output `a`:
    /// h' = h + post(a), out = h' + post(mlp(norm(h'))); with `next`, a norm weight, also
    /// out's norm by it (the next block's input, or the final norm), made with the sum.
    fn finish_block(
        &self,
        layer: &Block,
        h: Tensor,
        a: Tensor,
        mlp_adapters: Option<(&RowAdapters, usize)>,
        next: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let cfg = &self.config;
        let a = match &layer.post_norms {
            Some(n) => model_norm(&a, &n.attn, cfg)?,
            None => a,
        };
        let (h, x) = add_model_norm(&h, &a, &layer.post_attention_layernorm, cfg)?;
        let m = match &layer.mlp {
            FeedForward::Dense(mlp) => mlp.forward(&x, mlp_adapters, cfg.gemma3.is_some())?,
            FeedForward::Sparse(moe) => moe.forward(&x)?,
        };
        let m = match &layer.post_norms {
            Some(n) => model_norm(&m, &n.mlp, cfg)?,
            None => m,
        };
        Ok(match next {
            Some(w) => {
                let (out, normed) = add_model_norm(&h, &m, w, cfg)?;
                (out, Some(normed))
            }
            None => ((h + m)?, None),
        })
    }

    /// Block `i` of a training forward (no cache, no per-row adapters) on `h` [B, T, hidden]:
    /// the operations [`Transformer::forward_hidden`] runs for it, so the same graph and bits.
    pub(crate) fn train_block(&self, i: usize, h: &Tensor, inputs: &BlockInputs) -> Result<Tensor> {
        let (layer, cfg) = (&self.layers[i], &self.config);
        let x = model_norm(h, &layer.input_layernorm, cfg)?;
        let a = match &layer.mixer {
            Mixer::Attention(attn) => {
                let local = inputs.local.as_ref().filter(|_| attn.sliding);
                let cos_sin = local.map_or(&inputs.cos_sin, |l| &l.cos_sin);
                let bias = match local {
                    Some(l) => l.bias(0)?,
                    None => inputs.bias.clone(),
                };
                attn.forward(&x, cfg, cos_sin, &bias, None, None)?
            }
            Mixer::DeltaNet(dn) => {
                let dnc = cfg.delta_net.as_ref().expect("a DeltaNet layer has its config");
                dn.forward(&x, dnc, cfg.rms_norm_eps, &inputs.mask, None, None)?
            }
        };
        Ok(self.finish_block(layer, h.clone(), a, None, None)?.0)
    }

    /// What every block of a training forward reads besides its input (see
    /// [`Transformer::train_block`]).
    pub(crate) fn block_inputs(&self, positions: &[Vec<u32>], mask: &[Vec<u8>]) -> Result<BlockInputs> {
        let t = mask.first().map_or(0, Vec::len);
        Ok(BlockInputs {
            cos_sin: self.rope.tables(positions, self.compute_dtype())?,
            bias: attention_bias(mask, 0, t, &self.device)?,
            local: super::gemma3::LocalLayers::new(self, positions, mask, 0, t)?,
            mask: mask.to_vec(),
        })
    }

    /// Checks a batch's shapes and token ids; returns (rows, tokens per row).
    pub(crate) fn check_inputs(
        &self,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
    ) -> Result<(usize, usize)> {
        let b = input_ids.len();
        if b == 0 {
            return Err(Error::input("empty batch"));
        }
        let t = input_ids[0].len();
        if t == 0 {
            return Err(Error::input("input_ids rows are empty (sequence length 0)"));
        }
        for (name, rows) in [("positions", positions.len()), ("mask", mask.len())] {
            if rows != b {
                return Err(Error::input(format!("{name} has {rows} rows, input_ids has {b}")));
            }
        }
        for r in 0..b {
            if input_ids[r].len() != t || positions[r].len() != t || mask[r].len() != t {
                return Err(Error::input(format!("row {r}: input_ids, positions and mask must all have length {t}")));
            }
        }
        for (row, ids) in input_ids.iter().enumerate() {
            super::check_token_ids(ids, self.config.vocab_size, format_args!("row {row}"))?;
        }
        Ok((b, t))
    }

    /// Logits in f32 for hidden states [..., hidden].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.logits_adapted(hidden, None)
    }

    /// [`Transformer::logits`] with per-row LoRA adapters.
    pub fn logits_adapted(&self, hidden: &Tensor, adapters: Option<&RowAdapters>) -> Result<Tensor> {
        let index = self.first_linear(self.layers.len());
        Ok(RowAdapters::forward(adapters, &self.lm_head, hidden, index)?.to_dtype(DType::F32)?)
    }

    /// Full-vocabulary logits [B, T, V] in f32.
    pub fn forward(
        &self,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, positions, mask, cache)?;
        self.logits(&h)
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.num_hidden_layers)
    }

    /// An error unless this model can be trained: a DeltaNet layer's backward is the CPU tape's
    /// ([`super::tape`]; on another device candle's graph would not reach its parameters).
    pub fn check_trainable(&self) -> Result<()> {
        if self.config.moe.is_some() && !super::tape::Tape::serves(self) {
            return Err(Error::input(format!(
                "Qwen3-MoE's sparse MLPs train on the CPU only (the hand-written tape), not on {}",
                weights::device_name(&self.device)
            )));
        }
        if self.is_hybrid() && !super::tape::Tape::serves(self) {
            return Err(Error::input(format!(
                "Qwen3.5's Gated DeltaNet layers train on the CPU only (the hand-written tape), not on {}",
                weights::device_name(&self.device)
            )));
        }
        Ok(())
    }

    /// Whether any layer is a DeltaNet (its cache carries states, not keys and values).
    pub fn is_hybrid(&self) -> bool {
        self.config.delta_net.is_some()
    }

    /// Writes config.json and model.safetensors (in `dtype`) to `dir`, in the HF layout.
    pub fn save(&self, dir: &std::path::Path, dtype: DType) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
        let file = dir.join(weights::SINGLE_FILE);
        NamedTensors::from_vec(&file, self.named_params())?.to_dtype(dtype)?.save_file(&file)?;
        let mut cfg = self.config.raw.clone();
        cfg["torch_dtype"] = serde_json::Value::String(weights::dtype_name(dtype).into());
        if cfg.get("dtype").is_some() {
            cfg["dtype"] = serde_json::Value::String(weights::dtype_name(dtype).into());
        }
        write_json(&dir.join("config.json"), &cfg)
    }
}

impl Block {
    /// Projections of an attention block: q, k, v, o, gate, up, down, in this order (a
    /// projection's index is its block's first, [`Transformer::first_linear`], + k; lm_head
    /// comes after the last block's).
    pub const LINEARS: usize = 7;

    /// Projections of this block: the mixer's ([`Block::LINEARS`] − 3 for attention,
    /// [`GatedDeltaNet::LINEARS`] for a DeltaNet), then gate, up, down of a dense MLP (a sparse
    /// MLP's router and experts are not among them).
    pub fn num_linears(&self) -> usize {
        let mlp = match &self.mlp {
            FeedForward::Dense(_) => 3,
            FeedForward::Sparse(_) => 0,
        };
        mlp + match &self.mixer {
            Mixer::Attention(_) => Block::LINEARS - 3,
            Mixer::DeltaNet(_) => GatedDeltaNet::LINEARS,
        }
    }

    /// The projections of one block by their name inside it, in index order.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out: Vec<(&'static str, &mut Linear)> = match &mut self.mixer {
            Mixer::Attention(a) => vec![
                ("self_attn.q_proj", &mut a.q_proj),
                ("self_attn.k_proj", &mut a.k_proj),
                ("self_attn.v_proj", &mut a.v_proj),
                ("self_attn.o_proj", &mut a.o_proj),
            ],
            Mixer::DeltaNet(dn) => dn.linears_mut().into_iter().collect(),
        };
        if let FeedForward::Dense(m) = &mut self.mlp {
            out.extend([
                ("mlp.gate_proj", &mut m.gate_proj),
                ("mlp.up_proj", &mut m.up_proj),
                ("mlp.down_proj", &mut m.down_proj),
            ]);
        }
        out
    }

    /// The block's attention (None for a DeltaNet block).
    pub fn attention(&self) -> Option<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;

    /// The bias built from the key mask by tensor ops (a GPU's way; run here on the CPU) is the
    /// host loop's, bit for bit: left padding, a masked key in the middle, a cache before the
    /// queries, one query.
    #[test]
    fn bias_built_by_tensor_ops_is_the_host_loops() {
        let mask = vec![vec![0, 0, 1, 1, 1, 1, 1], vec![1, 1, 1, 0, 1, 1, 1], vec![1; 7]];
        for (past, t) in [(0, 7), (3, 4), (6, 1)] {
            let host = attention_bias(&mask, past, t, &Device::Cpu).unwrap();
            let ops = attention_bias_on_device(&mask, past, t, &Device::Cpu).unwrap();
            assert_eq!(ops.dims(), host.dims());
            assert_eq!(bits(&ops), bits(&host), "past {past}, t {t}");
        }
        assert!(attention_bias_on_device(&[vec![1; 3]], 0, 4, &Device::Cpu).is_err());
    }
}
