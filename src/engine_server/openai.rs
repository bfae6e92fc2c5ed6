//! The OpenAI-compatible API of `oxrl engine`: `GET /v1/models`, `POST /v1/completions`
//! ([`super::completions`]) and `POST /v1/chat/completions` ([`super::chat`]), so users evaluate
//! a policy with their usual clients (the `openai` client, lm-evaluation-harness, agent loops).
//! This file: what both endpoints share — errors, the request fields they take, the model list.
//!
//! Taken by both: `model` (the served name or path, or the name of a LoRA adapter the engine
//! holds: the request samples with it), `max_tokens`, `n`, `temperature` (default 1; 0 =
//! greedy), `top_p`, `top_k` and `ignore_eos` (extensions, as vLLM's), `seed` (sample j of a prompt draws from
//! `seed + j`), `stop` (a string or a list; the text ends before it, the token ids keep the token
//! that completed it), `stream` with `stream_options.include_usage` ([`super::streaming`]),
//! `logit_bias` (token id → bias in [-100, 100], added to the logit before each draw: the
//! reported log-probs are the biased distribution's, as for temperature), `user`. `best_of` must
//! equal `n`; penalties must be 0. Refused with a 400 naming the field: `suffix`, `functions`,
//! `function_call`, and any other field whose value asks for something the engine does not do. Each choice carries `token_ids` (an
//! extension: the sampled ids, the token-level truth RL and evaluation need). `usage` counts
//! each prompt's tokens once and every sampled token.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::EngineServer;
use crate::rollout::request::{Generation, StopReason, TopLogprobs};
use crate::rollout::SamplingParams;

/// An OpenAI-shaped error: status, message, the parameter at fault.
#[derive(Debug)]
pub struct OpenAiError(pub StatusCode, pub String, pub Option<String>);

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let kind = if self.0.is_server_error() { "server_error" } else { "invalid_request_error" };
        let body = json!({"error": {"message": self.1, "type": kind, "param": self.2, "code": null}});
        (self.0, Json(body)).into_response()
    }
}

pub fn invalid(param: &str, message: impl Into<String>) -> OpenAiError {
    OpenAiError(StatusCode::BAD_REQUEST, message.into(), Some(param.to_string()))
}

/// An engine error: the request's fault (400) or the engine's (500).
pub fn engine_error(e: crate::Error) -> OpenAiError {
    match e {
        crate::Error::Input(m) => OpenAiError(StatusCode::BAD_REQUEST, m, None),
        e => OpenAiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None),
    }
}

/// A request body, as a JSON object.
pub type Body = Map<String, Value>;

pub fn object(body: &[u8]) -> Result<Body, OpenAiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(invalid("body", "the body must be a JSON object")),
        Err(e) => Err(invalid("body", format!("the body is not JSON: {e}"))),
    }
}

/// The adapter `model` names (None: the engine's own weights), or a 404.
pub fn adapter_of(s: &EngineServer, o: &Body) -> Result<Option<String>, OpenAiError> {
    let model = o.get("model").and_then(Value::as_str).ok_or_else(|| invalid("model", "`model` is required"))?;
    if s.serves(model) {
        return Ok(None);
    }
    if s.adapters.iter().any(|a| a == model) {
        return Ok(Some(model.to_string()));
    }
    let mut known = vec![s.name.clone()];
    known.extend(s.adapters.iter().cloned());
    Err(OpenAiError(
        StatusCode::NOT_FOUND,
        format!("the model `{model}` does not exist here; this engine serves {}", known.join(", ")),
        Some("model".into()),
    ))
}

/// The fields no endpoint takes, and those whose only accepted value is a default.
pub fn refuse_unsupported(o: &Body, refused: &[&str]) -> Result<(), OpenAiError> {
    let set = |f: &str| o.get(f).is_some_and(|v| !v.is_null());
    for field in refused.iter().chain(&["functions", "function_call"]) {
        if set(field) {
            return Err(invalid(field, format!("`{field}` is not supported by oxrl engine")));
        }
    }
    for field in ["presence_penalty", "frequency_penalty", "repetition_penalty"] {
        let neutral = if field == "repetition_penalty" { 1.0 } else { 0.0 };
        if let Some(v) = o.get(field).filter(|v| !v.is_null()) {
            if v.as_f64() != Some(neutral) {
                return Err(invalid(field, format!("`{field}` other than {neutral} is not supported")));
            }
        }
    }
    Ok(())
}

pub fn uint(o: &Body, key: &str) -> Result<Option<usize>, OpenAiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| invalid(key, format!("`{key}` must be a non-negative integer"))),
    }
}

pub fn flag(o: &Body, key: &str) -> Result<bool, OpenAiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(key, format!("`{key}` must be true or false"))),
    }
}

fn number(o: &Body, key: &str, default: f64) -> Result<f64, OpenAiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| invalid(key, format!("`{key}` must be a number"))),
    }
}

/// What both endpoints take about sampling: the engine's parameters with `max_tokens` as given,
/// and `n`.
pub fn sampling(o: &Body, max_tokens: usize) -> Result<(SamplingParams, usize), OpenAiError> {
    let stop_strings = match o.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(String::from).ok_or_else(|| invalid("stop", "`stop` must be strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid("stop", "`stop` must be a string or a list of strings")),
    };
    let params = SamplingParams {
        max_tokens,
        temperature: number(o, "temperature", 1.0)?,
        top_k: uint(o, "top_k")?.unwrap_or(0),
        top_p: number(o, "top_p", 1.0)?,
        seed: match o.get("seed") {
            None | Some(Value::Null) => None,
            // Negative seeds (some clients send -1 or random i64s) map onto the u64 range.
            Some(v) => Some(
                v.as_i64()
                    .map(|i| i as u64)
                    .or(v.as_u64())
                    .ok_or_else(|| invalid("seed", "`seed` must be an integer"))?,
            ),
        },
        stop_token_ids: vec![],
        stop_strings,
        ignore_eos: flag(o, "ignore_eos")?,
    };
    if params.stop_strings.iter().any(String::is_empty) {
        return Err(invalid("stop", "a stop string is empty"));
    }
    params.validate().map_err(|e| invalid("body", e.to_string()))?;
    let n = uint(o, "n")?.unwrap_or(1);
    if n == 0 || n > 128 {
        return Err(invalid("n", "`n` must be between 1 and 128"));
    }
    if let Some(b) = uint(o, "best_of")? {
        if b != n {
            return Err(invalid("best_of", format!("`best_of` ({b}) other than `n` ({n}) is not supported")));
        }
    }
    Ok((params, n))
}

/// `logit_bias`: token id (as a string) → bias in [-100, 100], added to the token's logit before
/// each draw.
pub fn logit_bias(s: &EngineServer, o: &Body) -> Result<Vec<(u32, f32)>, OpenAiError> {
    let map = match o.get("logit_bias") {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(invalid("logit_bias", "`logit_bias` must be an object of token id → bias")),
    };
    let mut out = vec![];
    for (k, v) in map {
        let token = k.parse::<u32>().ok().filter(|&t| (t as usize) < s.vocab_size);
        let bias = v.as_f64().filter(|b| (-100.0..=100.0).contains(b));
        match (token, bias) {
            (Some(t), Some(b)) => out.push((t, b as f32)),
            _ => {
                return Err(invalid(
                    "logit_bias",
                    format!("`logit_bias` {k}: {v}: a token id below {} and a bias in [-100, 100]", s.vocab_size),
                ))
            }
        }
    }
    Ok(out)
}

/// `stream` and `stream_options.include_usage`.
pub fn streaming(o: &Body) -> Result<(bool, bool), OpenAiError> {
    let stream = flag(o, "stream")?;
    let usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) if stream => flag(so, "include_usage")
            .map_err(|_| invalid("stream_options", "`stream_options.include_usage` must be true or false"))?,
        Some(Value::Object(_)) => return Err(invalid("stream_options", "`stream_options` needs `stream: true`")),
        Some(_) => return Err(invalid("stream_options", "`stream_options` must be an object")),
    };
    Ok((stream, usage))
}

/// The prompt length plus `max_tokens` must fit the model, and the ids its vocabulary: checked
/// before anything runs, so that a streamed request is refused with a status rather than in
/// its stream.
pub fn check_prompt(s: &EngineServer, param: &str, prompt: &[u32], max_tokens: usize) -> Result<(), OpenAiError> {
    if prompt.is_empty() {
        return Err(invalid(param, "the prompt is empty"));
    }
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= s.vocab_size) {
        return Err(invalid(param, format!("token id {bad} is out of range for the vocabulary of {}", s.vocab_size)));
    }
    if prompt.len() + max_tokens > s.context {
        return Err(invalid(
            "max_tokens",
            format!(
                "the prompt's {} tokens + max_tokens {max_tokens} exceed the model's context of {}",
                prompt.len(),
                s.context
            ),
        ));
    }
    Ok(())
}

pub fn finish_reason(g: &Generation) -> &'static str {
    match g.stop_reason {
        StopReason::Length => "length",
        _ => "stop",
    }
}

pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens})
}

/// Text of `tokens` without special tokens.
pub fn text(s: &EngineServer, tokens: &[u32]) -> Result<String, OpenAiError> {
    s.tokenizer.decode(tokens, true).map_err(|e| OpenAiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None))
}

/// One token's text as log-prob listings name it (special tokens included).
pub fn piece(s: &EngineServer, token: u32) -> String {
    s.tokenizer.decode(&[token], false).unwrap_or_default()
}

/// A completion's text: its tokens decoded, ending before the first stop string it holds when
/// one ended it.
pub fn completion_text(s: &EngineServer, g: &Generation, stops: &[String]) -> Result<String, OpenAiError> {
    let mut t = text(s, &g.tokens)?;
    if g.stop_reason == StopReason::Stop {
        if let Some(cut) = stops.iter().filter_map(|stop| t.find(stop.as_str())).min() {
            t.truncate(cut);
        }
    }
    Ok(t)
}

/// Top log-probs as a token-text → log-prob map (completions' form).
pub fn top_map(s: &EngineServer, top: &TopLogprobs) -> Value {
    Value::Object(top.iter().map(|(t, l)| (piece(s, *t), json!(l))).collect())
}

pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The served model, and each LoRA adapter the engine holds (`parent`: the model).
pub async fn models(State(s): State<Arc<EngineServer>>) -> Json<Value> {
    let mut data = vec![json!({"id": s.name, "object": "model", "created": 0, "owned_by": "oxrl", "root": s.path,
                               "parent": null, "max_model_len": s.context})];
    for a in &s.adapters {
        data.push(json!({"id": a, "object": "model", "created": 0, "owned_by": "oxrl", "root": a,
                         "parent": s.name, "max_model_len": s.context}));
    }
    Json(json!({"object": "list", "data": data}))
}
