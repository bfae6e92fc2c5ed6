//! The JSON bodies the SDK sends, each with its validation (`to_params`, [`expiry`], …), and
//! [`parse_json`]. Unknown JSON fields are ignored (newer SDKs add some); a field of the wrong
//! type is a user error naming it. The datums and outputs on the wire (JSON and protobuf) are
//! converted in [`wire`](super::wire).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::errors::{ApiError, ApiResult};
use super::wire::JsonModelInput;
use crate::worker::AdamParams;

#[derive(Deserialize)]
pub struct CreateSessionRequest {
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub user_metadata: Option<Value>,
    #[serde(default)]
    pub sdk_version: Option<String>,
}

#[derive(Deserialize)]
pub struct SessionRequest {
    pub session_id: String,
}

#[derive(Deserialize, Serialize, Clone, Debug)]
pub struct LoraConfigWire {
    #[serde(default = "default_rank")]
    pub rank: usize,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default = "yes")]
    pub train_unembed: bool,
    #[serde(default = "yes")]
    pub train_mlp: bool,
    #[serde(default = "yes")]
    pub train_attn: bool,
}

fn default_rank() -> usize {
    32
}

fn yes() -> bool {
    true
}

impl Default for LoraConfigWire {
    fn default() -> Self {
        LoraConfigWire { rank: 32, seed: None, train_unembed: true, train_mlp: true, train_attn: true }
    }
}

#[derive(Deserialize)]
pub struct CreateModelRequest {
    pub session_id: String,
    pub model_seq_id: i64,
    pub base_model: String,
    #[serde(default)]
    pub lora_config: Option<LoraConfigWire>,
    #[serde(default)]
    pub optimizer_config: Option<Value>,
    #[serde(default)]
    pub user_metadata: Option<Value>,
}

#[derive(Deserialize)]
pub struct ModelRequest {
    pub model_id: String,
}

#[derive(Deserialize)]
pub struct OptimStepRequest {
    pub model_id: String,
    pub seq_id: i64,
    #[serde(default)]
    pub adam_params: Option<AdamParamsWire>,
}

/// Tinker's `AdamParams`; absent fields take the crate's (= Tinker's) defaults.
#[derive(Deserialize, Default)]
pub struct AdamParamsWire {
    pub learning_rate: Option<f64>,
    pub beta1: Option<f64>,
    pub beta2: Option<f64>,
    pub eps: Option<f64>,
    pub weight_decay: Option<f64>,
    pub grad_clip_norm: Option<f64>,
}

impl AdamParamsWire {
    pub fn to_params(&self) -> AdamParams {
        let d = AdamParams::default();
        AdamParams {
            learning_rate: self.learning_rate.unwrap_or(d.learning_rate),
            beta1: self.beta1.unwrap_or(d.beta1),
            beta2: self.beta2.unwrap_or(d.beta2),
            eps: self.eps.unwrap_or(d.eps),
            weight_decay: self.weight_decay.unwrap_or(d.weight_decay),
            grad_clip_norm: self.grad_clip_norm.unwrap_or(d.grad_clip_norm),
        }
    }
}

#[derive(Deserialize)]
pub struct SaveWeightsRequest {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    pub seq_id: i64,
    #[serde(default)]
    pub overwrite: bool,
    /// Seconds until the checkpoint expires; None = kept.
    #[serde(default)]
    pub ttl_seconds: Option<i64>,
}

/// `save_weights_external`: `path` is the checkpoint name; with recipients every file is
/// age-encrypted to them.
#[derive(Deserialize)]
pub struct SaveWeightsExternalRequest {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    pub seq_id: i64,
    #[serde(default)]
    pub ttl_seconds: Option<i64>,
    #[serde(default)]
    pub age_encryption_recipients: Option<Vec<String>>,
}

/// Unix time `ttl_seconds` from now (None: no expiry); a TTL below one second is a user error.
pub fn expiry(ttl_seconds: Option<i64>) -> ApiResult<Option<f64>> {
    match ttl_seconds {
        None => Ok(None),
        Some(t) if t >= 1 => Ok(Some(super::store::now() + t as f64)),
        Some(t) => Err(ApiError::user(format!("ttl_seconds must be at least 1, got {t}"))),
    }
}

/// `PUT …/checkpoints/{id}/ttl`.
#[derive(Deserialize)]
pub struct SetTtlRequest {
    pub ttl_seconds: Option<i64>,
}

/// `load_weights`: onto an existing model (`model_id` + `seq_id`) or creating one from the
/// checkpoint (`session_id` + `model_seq_id`).
#[derive(Deserialize)]
pub struct LoadWeightsRequest {
    #[serde(default)]
    pub model_id: Option<String>,
    #[serde(default)]
    pub seq_id: Option<i64>,
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub model_seq_id: Option<i64>,
    #[serde(default)]
    pub base_model: Option<String>,
    pub path: String,
    #[serde(default)]
    pub optimizer: bool,
    /// Kept with the run a load creates (as `create_model`'s), so the cookbook finds its renderer.
    #[serde(default)]
    pub user_metadata: Option<Value>,
}

#[derive(Deserialize)]
pub struct WeightsInfoRequest {
    pub tinker_path: String,
}

#[derive(Deserialize)]
pub struct SaveWeightsForSamplerRequest {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub sampling_session_seq_id: Option<i64>,
    pub seq_id: i64,
    #[serde(default)]
    pub ttl_seconds: Option<i64>,
}

#[derive(Deserialize)]
pub struct CreateSamplingSessionRequest {
    pub session_id: String,
    pub sampling_session_seq_id: i64,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(default)]
    pub base_model: Option<String>,
}

#[derive(Deserialize)]
pub struct SampleRequest {
    #[serde(default = "one")]
    pub num_samples: usize,
    pub prompt: JsonModelInput,
    #[serde(default)]
    pub sampling_params: SamplingParamsWire,
    #[serde(default)]
    pub sampling_session_id: Option<String>,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(default)]
    pub prompt_logprobs: Option<bool>,
    #[serde(default)]
    pub topk_prompt_logprobs: Option<i64>,
    #[serde(default)]
    pub topk_sample_logprobs: Option<i64>,
    #[serde(default)]
    pub prompt_logprobs_last_n: Option<i64>,
    /// Not supported: refused when present.
    #[serde(default)]
    pub target_prompt_logprobs: Option<Value>,
    /// Keep each sequence's tokens and log-probs for `stable_reinforce`.
    #[serde(default)]
    pub record_stability_info: Option<bool>,
    #[serde(default)]
    pub prompt_alt_tokens_k: Option<i64>,
}

fn one() -> usize {
    1
}

/// Tinker's `stop`: a string, strings, or token ids.
#[derive(Deserialize, Clone, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Ids(Vec<i64>),
    Strings(Vec<String>),
}

#[derive(Deserialize, Default, Clone, Debug)]
pub struct SamplingParamsWire {
    pub max_tokens: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub temperature: Option<f64>,
    pub top_k: Option<i64>,
    pub top_p: Option<f64>,
}

/// Tokens when `max_tokens` is absent.
pub const DEFAULT_MAX_TOKENS: usize = 64;

impl SamplingParamsWire {
    /// The engine's parameters: `top_k` −1 (Tinker's "all") is 0; `stop` absent = stop at EOS,
    /// given (even `[]`) = exactly those stops.
    pub fn to_params(&self) -> ApiResult<crate::rollout::SamplingParams> {
        let max_tokens = match self.max_tokens {
            None => DEFAULT_MAX_TOKENS,
            Some(n) if n >= 1 => n as usize,
            Some(n) => return Err(ApiError::user(format!("sampling_params.max_tokens must be ≥ 1, got {n}"))),
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(ApiError::user(format!("sampling_params.top_k must be -1 or ≥ 1, got {k}"))),
        };
        let temperature = self.temperature.unwrap_or(1.0);
        let top_p = self.top_p.unwrap_or(1.0);
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(ApiError::user(format!("sampling_params.temperature must be ≥ 0, got {temperature}")));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::user(format!("sampling_params.top_p must be in (0, 1], got {top_p}")));
        }
        let mut params = crate::rollout::SamplingParams {
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed: self.seed,
            ..Default::default()
        };
        match &self.stop {
            None => {}
            Some(stop) => {
                params.ignore_eos = true;
                match stop {
                    Stop::One(s) => params.stop_strings = vec![s.clone()],
                    Stop::Strings(v) => params.stop_strings = v.clone(),
                    Stop::Ids(v) => {
                        params.stop_token_ids = v
                            .iter()
                            .map(|&x| {
                                u32::try_from(x)
                                    .map_err(|_| ApiError::user(format!("stop token id {x} is out of range")))
                            })
                            .collect::<ApiResult<_>>()?
                    }
                }
            }
        }
        Ok(params)
    }
}

#[derive(Deserialize)]
pub struct RetrieveFutureRequest {
    pub request_id: String,
}

/// Parses a JSON body; a malformed one is a user error with serde's message (and path).
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> ApiResult<T> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path.is_empty() || path == "." {
            ApiError::user(format!("{what}: malformed JSON body: {}", e.inner()))
        } else {
            ApiError::user(format!("{what}: field `{path}`: {}", e.inner()))
        }
    })
}
