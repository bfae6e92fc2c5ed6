//! The protocol's datums and outputs on the wire, JSON or protobuf, to and from the worker's
//! [`Datum`] / [`ForwardBackwardOutput`]: a forward / forward_backward request ([`FwdBwd`], with
//! each datum's provenance), loss outputs, sampling results. A tensor of the wrong length or
//! type is a user error naming it.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::errors::{ApiError, ApiResult};
use super::proto;
use super::provenance::Provenance;
use super::types::parse_json;
use crate::worker::{Datum, ForwardBackwardOutput, LossFnInputs, LossFnOutput};

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
