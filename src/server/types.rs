//! Wire types: the JSON bodies the SDK sends and expects, and the conversions between the
//! protocol's datums / outputs (JSON or protobuf) and the worker's [`Datum`] /
//! [`ForwardBackwardOutput`]. Unknown JSON fields are ignored (newer SDKs add some); a field of
//! the wrong type or a tensor of the wrong length is a user error naming it.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::errors::{ApiError, ApiResult};
use super::proto;
use super::provenance::Provenance;
use crate::worker::{AdamParams, Datum, ForwardBackwardOutput, LossFnInputs, LossFnOutput};

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

/// A forward / forward_backward request, from either encoding.
pub struct FwdBwd {
    pub model_id: String,
    pub seq_id: i64,
    pub data: Vec<Datum>,
    pub loss_fn: String,
    pub loss_fn_config: Value,
    pub forward_only: bool,
    /// Each datum's provenance, if it has any (protobuf bodies only).
    pub provenance: Vec<Option<Provenance>>,
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

// ---- forward_backward: protobuf ----

impl FwdBwd {
    pub fn from_proto(body: &[u8]) -> ApiResult<FwdBwd> {
        use prost::Message;
        let req = proto::ForwardBackwardRequest::decode(body)
            .map_err(|e| ApiError::user(format!("forward_backward: malformed protobuf body: {e}")))?;
        let mut data = Vec::with_capacity(req.data.len());
        let mut provenance = Vec::with_capacity(req.data.len());
        for (i, d) in req.data.iter().enumerate() {
            let datum = datum_from_proto(i, d)?;
            let targets = datum.loss_fn_inputs.target_tokens.as_ref().map_or(0, Vec::len);
            provenance.push(super::provenance::from_proto(i, d, datum.input_tokens.len(), targets)?);
            data.push(datum);
        }
        // v2 (numbers and strings) wins over the legacy numbers-only map.
        let mut config = Map::new();
        for (k, v) in &req.loss_fn_config {
            config.insert(k.clone(), json!(v));
        }
        for (k, v) in &req.loss_fn_config_v2 {
            match &v.value {
                Some(proto::loss_config_value::Value::Number(x)) => config.insert(k.clone(), json!(x)),
                Some(proto::loss_config_value::Value::Text(s)) => config.insert(k.clone(), json!(s)),
                None => None,
            };
        }
        Ok(FwdBwd {
            model_id: req.model_id,
            seq_id: req.seq_id as i64,
            data,
            loss_fn: req.loss_fn,
            loss_fn_config: Value::Object(config),
            forward_only: req.forward_only,
            provenance,
        })
    }

    /// The JSON form older SDKs send: `{model_id, seq_id, forward_backward_input: {data,
    /// loss_fn, loss_fn_config}}` (`forward_input` for `forward`).
    pub fn from_json(body: &[u8], forward_only: bool) -> ApiResult<FwdBwd> {
        #[derive(Deserialize)]
        struct Input {
            data: Vec<JsonDatum>,
            loss_fn: String,
            #[serde(default)]
            loss_fn_config: Option<Map<String, Value>>,
        }
        #[derive(Deserialize)]
        struct Req {
            model_id: String,
            #[serde(default)]
            seq_id: Option<i64>,
            #[serde(default)]
            forward_backward_input: Option<Input>,
            #[serde(default)]
            forward_input: Option<Input>,
        }
        let what = if forward_only { "forward" } else { "forward_backward" };
        let req: Req = parse_json(body, what)?;
        let input = req
            .forward_backward_input
            .or(req.forward_input)
            .ok_or_else(|| ApiError::user(format!("{what}: missing `forward_backward_input`")))?;
        let data = input.data.iter().enumerate().map(|(i, d)| d.to_datum(i)).collect::<ApiResult<Vec<_>>>()?;
        Ok(FwdBwd {
            provenance: vec![None; data.len()],
            model_id: req.model_id,
            seq_id: req.seq_id.unwrap_or(0),
            data,
            loss_fn: input.loss_fn,
            loss_fn_config: Value::Object(input.loss_fn_config.unwrap_or_default()),
            forward_only,
        })
    }
}

fn datum_from_proto(i: usize, d: &proto::Datum) -> ApiResult<Datum> {
    let mut tokens = vec![];
    for c in &d.model_input {
        match &c.chunk {
            Some(proto::chunk::Chunk::EncodedText(t)) => {
                if t.tokens.len() % 4 != 0 {
                    return Err(ApiError::user(format!(
                        "datum {i}: model_input tokens are {} bytes, not a multiple of 4 (int32)",
                        t.tokens.len()
                    )));
                }
                for b in t.tokens.chunks_exact(4) {
                    let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    tokens.push(token_id(i, "model_input", v as i64)?);
                }
            }
            Some(_) => return Err(ApiError::user(format!("datum {i}: only encoded_text chunks are supported"))),
            None => {}
        }
    }
    let mut fields = BTreeMap::new();
    for (name, t) in &d.loss_fn_inputs {
        fields.insert(name.clone(), tensor_from_proto(i, name, t)?);
    }
    make_datum(i, tokens, fields)
}

/// A loss input as numbers (f64 holds every int64 token id and f32 exactly).
enum Values {
    Float(Vec<f32>),
    Int(Vec<i64>),
}

fn tensor_from_proto(i: usize, name: &str, t: &proto::Tensor) -> ApiResult<Values> {
    let dense = match &t.encoding {
        Some(proto::tensor::Encoding::Dense(b)) => b,
        Some(proto::tensor::Encoding::SparseCsr(_)) => {
            return Err(ApiError::user(format!("datum {i}: loss_fn_inputs.{name}: sparse tensors are not supported")))
        }
        None => return Ok(Values::Float(vec![])),
    };
    let bad = |w: usize| {
        ApiError::user(format!("datum {i}: loss_fn_inputs.{name}: {} bytes is not a multiple of {w}", dense.len()))
    };
    match proto::DType::try_from(t.dtype) {
        Ok(proto::DType::Float32) => {
            if dense.len() % 4 != 0 {
                return Err(bad(4));
            }
            Ok(Values::Float(dense.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
        }
        Ok(proto::DType::Int64) => {
            if dense.len() % 8 != 0 {
                return Err(bad(8));
            }
            Ok(Values::Int(dense.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()))
        }
        Ok(proto::DType::Int32) => {
            if dense.len() % 4 != 0 {
                return Err(bad(4));
            }
            Ok(Values::Int(dense.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64).collect()))
        }
        _ => Err(ApiError::user(format!("datum {i}: loss_fn_inputs.{name}: unsupported dtype {}", t.dtype))),
    }
}

fn token_id(i: usize, field: &str, v: i64) -> ApiResult<u32> {
    u32::try_from(v).map_err(|_| ApiError::user(format!("datum {i}: {field}: token id {v} is out of range")))
}

/// The loss inputs Tinker's losses read, by their wire names.
const FLOAT_INPUTS: [&str; 7] =
    ["weights", "logprobs", "advantages", "ref_logprobs", "rollout_logprobs", "values", "returns"];

fn make_datum(i: usize, input_tokens: Vec<u32>, fields: BTreeMap<String, Values>) -> ApiResult<Datum> {
    let mut inputs = LossFnInputs::default();
    for (name, values) in fields {
        if name == "target_tokens" {
            let ids = match values {
                Values::Int(v) => v
                    .into_iter()
                    .map(|x| token_id(i, "loss_fn_inputs.target_tokens", x))
                    .collect::<ApiResult<Vec<_>>>()?,
                Values::Float(v) => v
                    .into_iter()
                    .map(|x| {
                        if x.fract() != 0.0 {
                            return Err(ApiError::user(format!(
                                "datum {i}: loss_fn_inputs.target_tokens: {x} is not an integer"
                            )));
                        }
                        token_id(i, "loss_fn_inputs.target_tokens", x as i64)
                    })
                    .collect::<ApiResult<Vec<_>>>()?,
            };
            inputs.target_tokens = Some(ids);
            continue;
        }
        let floats = match values {
            Values::Float(v) => v,
            Values::Int(v) => v.into_iter().map(|x| x as f32).collect(),
        };
        let slot = match name.as_str() {
            "weights" => &mut inputs.weights,
            "logprobs" => &mut inputs.logprobs,
            "advantages" => &mut inputs.advantages,
            "ref_logprobs" => &mut inputs.ref_logprobs,
            "rollout_logprobs" => &mut inputs.rollout_logprobs,
            "values" => &mut inputs.values,
            "returns" => &mut inputs.returns,
            other => {
                let mut valid = vec!["target_tokens"];
                valid.extend(FLOAT_INPUTS);
                return Err(ApiError::user(format!(
                    "datum {i}: unknown loss_fn_inputs key `{other}` (valid: {})",
                    valid.join(", ")
                )));
            }
        };
        *slot = Some(floats);
    }
    Ok(Datum { input_tokens, loss_fn_inputs: inputs })
}

// ---- forward_backward: JSON ----

#[derive(Deserialize)]
struct JsonDatum {
    model_input: JsonModelInput,
    #[serde(default)]
    loss_fn_inputs: HashMap<String, JsonTensor>,
}

#[derive(Deserialize)]
pub struct JsonModelInput {
    chunks: Vec<Value>,
}

impl JsonModelInput {
    /// The token ids of the encoded_text chunks (other chunk types are a user error).
    pub fn tokens(&self, what: &str) -> ApiResult<Vec<u32>> {
        let mut tokens = vec![];
        for c in &self.chunks {
            let ty = c.get("type").and_then(Value::as_str).unwrap_or("encoded_text");
            if ty != "encoded_text" {
                return Err(ApiError::user(format!("{what}: only encoded_text chunks are supported, not `{ty}`")));
            }
            let ids = c
                .get("tokens")
                .and_then(Value::as_array)
                .ok_or_else(|| ApiError::user(format!("{what}: an encoded_text chunk needs `tokens`")))?;
            for v in ids {
                let v = v.as_i64().ok_or_else(|| ApiError::user(format!("{what}: token {v} is not an integer")))?;
                tokens.push(
                    u32::try_from(v).map_err(|_| ApiError::user(format!("{what}: token id {v} is out of range")))?,
                );
            }
        }
        Ok(tokens)
    }
}

#[derive(Deserialize)]
struct JsonTensor {
    data: Vec<f64>,
    #[serde(default)]
    dtype: Option<String>,
}

impl JsonDatum {
    fn to_datum(&self, i: usize) -> ApiResult<Datum> {
        let tokens = self.model_input.tokens(&format!("datum {i}: model_input"))?;
        let mut fields = BTreeMap::new();
        for (name, t) in &self.loss_fn_inputs {
            let values = match t.dtype.as_deref() {
                Some("int64") => Values::Int(t.data.iter().map(|x| *x as i64).collect()),
                _ if name == "target_tokens" => Values::Int(t.data.iter().map(|x| *x as i64).collect()),
                _ => Values::Float(t.data.iter().map(|x| *x as f32).collect()),
            };
            fields.insert(name.clone(), values);
        }
        make_datum(i, tokens, fields)
    }
}

// ---- outputs ----

/// The worker's metrics as the protocol wants them: `name:reduction` → value.
pub fn metrics(out: &ForwardBackwardOutput) -> BTreeMap<String, f64> {
    out.metrics.reduce()
}

/// `ForwardBackwardOutput` as protobuf: one batched `ArrayRecord` with `logprobs` and
/// `elementwise_loss` (float32, one slice per datum, byte offsets).
pub fn output_to_proto(out: &ForwardBackwardOutput) -> Vec<u8> {
    use prost::Message;
    let batched = |field: fn(&LossFnOutput) -> &Vec<f32>| {
        let mut data = Vec::new();
        let mut offsets = Vec::with_capacity((out.loss_fn_outputs.len() + 1) * 8);
        offsets.extend_from_slice(&0i64.to_le_bytes());
        for o in &out.loss_fn_outputs {
            for x in field(o) {
                data.extend_from_slice(&x.to_le_bytes());
            }
            offsets.extend_from_slice(&(data.len() as i64).to_le_bytes());
        }
        proto::BatchedTensor { data, offsets, dtype: proto::DType::Float32 as i32, trailing_shape: vec![] }
    };
    let mut fields = HashMap::new();
    fields.insert("logprobs".to_string(), batched(|o| &o.logprobs));
    fields.insert("elementwise_loss".to_string(), batched(|o| &o.elementwise_loss));
    let record =
        proto::ArrayRecord { type_tag: "ArrayRecord".into(), fields, num_datums: out.loss_fn_outputs.len() as i64 };
    proto::ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![record],
        metrics: metrics(out).into_iter().collect(),
    }
    .encode_to_vec()
}

/// `ForwardBackwardOutput` as JSON (for clients that do not accept protobuf).
pub fn output_to_json(out: &ForwardBackwardOutput) -> Value {
    let tensor = |v: &[f32]| json!({"data": v, "dtype": "float32", "shape": [v.len()]});
    let outputs: Vec<Value> = out
        .loss_fn_outputs
        .iter()
        .map(|o| json!({"logprobs": tensor(&o.logprobs), "elementwise_loss": tensor(&o.elementwise_loss)}))
        .collect();
    json!({"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": metrics(out)})
}

/// The SDK's filler for an empty top-k slot.
const TOPK_MASK_LOGPROB: f32 = -99999.0;

/// Top-k rows (None = a position without scores) as Tinker's dense `TopkLogprobs` and as JSON.
fn topk_to_proto_and_json(rows: &[Option<&[(u32, f32)]>], k: usize) -> (proto::TopkLogprobs, Value) {
    let (mut ids, mut lps) = (Vec::with_capacity(rows.len() * k * 4), Vec::with_capacity(rows.len() * k * 4));
    for row in rows {
        let row = row.unwrap_or(&[]);
        for j in 0..k {
            let (id, lp) = row.get(j).map_or((0, TOPK_MASK_LOGPROB), |&(id, lp)| (id as i32, lp));
            ids.extend(id.to_le_bytes());
            lps.extend(lp.to_le_bytes());
        }
    }
    let json: Vec<Value> =
        rows.iter().map(|r| json!(r.map(|r| r.iter().map(|&(id, lp)| json!([id, lp])).collect::<Vec<_>>()))).collect();
    (proto::TopkLogprobs { token_ids: ids, logprobs: lps, k: k as u32, length: rows.len() as u32 }, Value::Array(json))
}

/// A sampling result as protobuf `SampleResponse` and as JSON. `topk` = (prompt k, sample k);
/// `last_n`: only the last n prompt positions are reported (earlier ones as absent).
pub fn sample_to_proto_and_json(
    out: &crate::rollout::RequestOutput,
    topk: (usize, usize),
    last_n: Option<usize>,
) -> (Vec<u8>, Value) {
    use crate::rollout::StopReason;
    use prost::Message;
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let sample_topk = |g: &crate::rollout::Generation| {
        (topk.1 > 0)
            .then(|| topk_to_proto_and_json(&g.topk.iter().map(|r| Some(r.as_slice())).collect::<Vec<_>>(), topk.1))
    };
    let sequences = out
        .samples
        .iter()
        .map(|g| proto::SampledSequence {
            stop_reason: match g.stop_reason {
                StopReason::Length => proto::StopReason::Length as i32,
                _ => proto::StopReason::Stop as i32,
            },
            tokens: g.tokens.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect(),
            logprobs: Some(f32s(&g.logprobs)),
            topk_sampled_logprobs: sample_topk(g).map(|t| t.0),
        })
        .collect();
    // Tinker's prompt scores: one per prompt token, none for the first (and, with `last_n`, for
    // all but the last n).
    let first_scored = |len: usize| last_n.map_or(1, |n| len.saturating_sub(n).max(1));
    let prompt = out.prompt_logprobs.as_ref().map(|lp| {
        let len = lp.len() + 1;
        let mut v = vec![f32::NAN; first_scored(len)];
        v.extend_from_slice(&lp[first_scored(len) - 1..]);
        v
    });
    let prompt_topk = out.prompt_topk.as_ref().filter(|_| topk.0 > 0).map(|rows| {
        let from = first_scored(rows.len() + 1);
        let rows: Vec<Option<&[(u32, f32)]>> =
            (0..=rows.len()).map(|i| (i >= from).then(|| rows[i - 1].as_slice())).collect();
        topk_to_proto_and_json(&rows, topk.0)
    });
    let msg = proto::SampleResponse {
        sequences,
        prompt_logprobs: prompt.as_deref().map(f32s),
        topk_prompt_logprobs: prompt_topk.as_ref().map(|t| t.0.clone()),
        prompt_cache_hit_tokens: 0,
    };
    let json_sequences: Vec<Value> = out
        .samples
        .iter()
        .map(|g| {
            let reason = if g.stop_reason == StopReason::Length { "length" } else { "stop" };
            let topk = sample_topk(g).map(|t| t.1);
            json!({"tokens": g.tokens, "logprobs": g.logprobs, "stop_reason": reason, "topk_logprobs": topk})
        })
        .collect();
    let prompt_json: Option<Vec<Option<f32>>> =
        prompt.map(|v| v.into_iter().map(|x| if x.is_nan() { None } else { Some(x) }).collect());
    let json = json!({
        "type": "sample",
        "sequences": json_sequences,
        "prompt_logprobs": prompt_json,
        "topk_prompt_logprobs": prompt_topk.map(|t| t.1),
    });
    (msg.encode_to_vec(), json)
}
