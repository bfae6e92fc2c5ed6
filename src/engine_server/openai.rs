//! The OpenAI-compatible API of `oxrl engine`: `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions`, so users evaluate a policy with their usual clients.
//!
//! What is taken: `model` (the served name or path), `prompt` (a string or token ids) or
//! `messages` (rendered with the model's chat template), `max_tokens` (chat also
//! `max_completion_tokens`; default 16 for completions, the model's context for chat), `n`,
//! `temperature` (default 1; 0 = greedy), `top_p`, `seed`, `stop` (a string or a list), and
//! log-probs (`logprobs: k` for completions; `logprobs: true` + `top_logprobs: k` for chat).
//! Each choice also carries `token_ids`, the sampled ids (an extension: the token-level truth
//! that RL and evaluation need). Not supported (an error names the field): `stream`, `echo`,
//! `suffix`, `best_of`, `tools`, and sampling penalties other than 0. Text is decoded without
//! special tokens.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::EngineServer;
use crate::rollout::request::{Generation, Request, StopReason};
use crate::rollout::SamplingParams;

/// An OpenAI-shaped error.
pub struct OpenAiError(StatusCode, String, Option<&'static str>);

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let body =
            json!({"error": {"message": self.1, "type": "invalid_request_error", "param": self.2, "code": null}});
        (self.0, Json(body)).into_response()
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> OpenAiError {
    OpenAiError(StatusCode::BAD_REQUEST, message.into(), Some(param))
}

type OpenAiResult = Result<Json<Value>, OpenAiError>;

pub async fn models(State(s): State<Arc<EngineServer>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": s.name, "object": "model", "created": 0, "owned_by": "oxrl"}]}))
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<serde_json::Map<String, Value>, OpenAiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(invalid("body", "the body must be a JSON object")),
        Err(e) => Err(invalid("body", format!("the body is not JSON: {e}"))),
    }
}

fn check_model(s: &EngineServer, o: &serde_json::Map<String, Value>) -> Result<(), OpenAiError> {
    let model = o.get("model").and_then(Value::as_str).ok_or_else(|| invalid("model", "`model` is required"))?;
    if !s.serves(model) {
        return Err(OpenAiError(
            StatusCode::NOT_FOUND,
            format!("the model `{model}` does not exist here; this engine serves `{}`", s.name),
            Some("model"),
        ));
    }
    for field in ["stream", "echo", "suffix", "best_of", "tools", "functions"] {
        if o.get(field).is_some_and(|v| !v.is_null() && v != &Value::Bool(false)) {
            return Err(invalid(field_name(field), format!("`{field}` is not supported by oxrl engine")));
        }
    }
    for field in ["presence_penalty", "frequency_penalty"] {
        if o.get(field).and_then(Value::as_f64).is_some_and(|p| p != 0.0) {
            return Err(invalid(field_name(field), format!("`{field}` other than 0 is not supported")));
        }
    }
    Ok(())
}

/// A static name for a field (OpenAI errors carry the parameter's name).
fn field_name(field: &str) -> &'static str {
    ["stream", "echo", "suffix", "best_of", "tools", "functions", "presence_penalty", "frequency_penalty"]
        .into_iter()
        .find(|f| *f == field)
        .unwrap_or("body")
}

fn uint(o: &serde_json::Map<String, Value>, key: &'static str) -> Result<Option<usize>, OpenAiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| invalid(key, format!("`{key}` must be a non-negative integer"))),
    }
}

fn number(o: &serde_json::Map<String, Value>, key: &'static str, default: f64) -> Result<f64, OpenAiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| invalid(key, format!("`{key}` must be a number"))),
    }
}

/// The sampling settings common to both endpoints, with `max_tokens` as given.
fn sampling(o: &serde_json::Map<String, Value>, max_tokens: usize) -> Result<(SamplingParams, usize), OpenAiError> {
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
        top_k: 0,
        top_p: number(o, "top_p", 1.0)?,
        seed: uint(o, "seed")?.map(|s| s as u64),
        stop_token_ids: vec![],
        stop_strings,
        ignore_eos: false,
    };
    params.validate().map_err(|e| invalid("body", e.to_string()))?;
    let n = uint(o, "n")?.unwrap_or(1);
    if n == 0 || n > 128 {
        return Err(invalid("n", "`n` must be between 1 and 128"));
    }
    Ok((params, n))
}

fn finish_reason(g: &Generation) -> &'static str {
    match g.stop_reason {
        StopReason::Length => "length",
        _ => "stop",
    }
}

fn usage(prompt: usize, samples: &[Generation]) -> Value {
    let completion: usize = samples.iter().map(|g| g.tokens.len()).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Runs the request on the engine.
async fn run(s: &EngineServer, req: Request) -> Result<Vec<Generation>, OpenAiError> {
    let out = s.engine.submit(req).await.map_err(|e| invalid("body", e.to_string()))?;
    Ok(out.samples)
}

fn text(s: &EngineServer, tokens: &[u32]) -> Result<String, OpenAiError> {
    s.tokenizer.decode(tokens, true).map_err(|e| OpenAiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None))
}

/// Each token's text, for the log-prob listings.
fn pieces(s: &EngineServer, tokens: &[u32]) -> Result<Vec<String>, OpenAiError> {
    tokens.iter().map(|&t| text(s, &[t])).collect()
}

pub async fn completions(State(s): State<Arc<EngineServer>>, body: axum::body::Bytes) -> OpenAiResult {
    let o = object(&body)?;
    check_model(&s, &o)?;
    let prompt: Vec<u32> = match o.get("prompt") {
        Some(Value::String(p)) => s.tokenizer.encode(p, true).map_err(|e| invalid("prompt", e.to_string()))?,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            s.tokenizer.encode(a[0].as_str().unwrap_or_default(), true).map_err(|e| invalid("prompt", e.to_string()))?
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_u64) => {
            a.iter().map(|v| v.as_u64().unwrap_or_default() as u32).collect()
        }
        _ => return Err(invalid("prompt", "`prompt` must be a string or a list of token ids (one prompt)")),
    };
    if prompt.is_empty() {
        return Err(invalid("prompt", "the prompt is empty"));
    }
    let (params, n) = sampling(&o, uint(&o, "max_tokens")?.unwrap_or(16))?;
    let logprobs = uint(&o, "logprobs")?;
    let mut req = Request::new(prompt.clone(), params);
    req.num_samples = n;
    req.sample_topk = logprobs.unwrap_or(0).min(20);
    let samples = run(&s, req).await?;
    let mut choices = vec![];
    for (i, g) in samples.iter().enumerate() {
        let lp = match logprobs {
            None => Value::Null,
            Some(_) => {
                let top: Vec<Value> = g
                    .topk
                    .iter()
                    .map(|k| {
                        let pairs: serde_json::Map<String, Value> =
                            k.iter().map(|(t, l)| (text(&s, &[*t]).unwrap_or_default(), json!(l))).collect();
                        Value::Object(pairs)
                    })
                    .collect();
                json!({"tokens": pieces(&s, &g.tokens)?, "token_logprobs": g.logprobs, "top_logprobs": top, "text_offset": []})
            }
        };
        choices.push(json!({
            "index": i, "text": text(&s, &g.tokens)?, "logprobs": lp, "finish_reason": finish_reason(g),
            "token_ids": g.tokens,
        }));
    }
    Ok(Json(json!({
        "id": format!("cmpl-{}", rand::random::<u64>()), "object": "text_completion", "created": now(),
        "model": s.name, "choices": choices, "usage": usage(prompt.len(), &samples),
    })))
}

pub async fn chat_completions(State(s): State<Arc<EngineServer>>, body: axum::body::Bytes) -> OpenAiResult {
    let o = object(&body)?;
    check_model(&s, &o)?;
    let messages = o.get("messages").and_then(Value::as_array).filter(|a| !a.is_empty());
    let messages = messages.ok_or_else(|| invalid("messages", "`messages` must be a non-empty list"))?;
    let prompt = s.tokenizer.encode_chat(messages, true, None).map_err(|e| invalid("messages", e.to_string()))?;
    let max_tokens = match uint(&o, "max_completion_tokens")? {
        Some(m) => Some(m),
        None => uint(&o, "max_tokens")?,
    };
    let context = s.engine.inspect(|m| m.config.max_position_embeddings).await.unwrap_or(2048);
    let (params, n) = sampling(&o, max_tokens.unwrap_or(context.saturating_sub(prompt.len()).max(1)))?;
    let logprobs = o.get("logprobs").and_then(Value::as_bool).unwrap_or(false);
    let top = uint(&o, "top_logprobs")?.unwrap_or(0);
    if top > 20 {
        return Err(invalid("top_logprobs", "`top_logprobs` must be at most 20"));
    }
    let mut req = Request::new(prompt.clone(), params);
    req.num_samples = n;
    req.sample_topk = if logprobs { top } else { 0 };
    let samples = run(&s, req).await?;
    let mut choices = vec![];
    for (i, g) in samples.iter().enumerate() {
        let lp = if logprobs {
            let content: Vec<Value> = (pieces(&s, &g.tokens)?.into_iter().enumerate())
                .map(|(k, piece)| {
                    let alternatives: Vec<Value> = g.topk.get(k).map_or(vec![], |alts| {
                        alts.iter()
                            .map(|(t, l)| {
                                let p = text(&s, &[*t]).unwrap_or_default();
                                json!({"token": p, "logprob": l, "bytes": p.as_bytes()})
                            })
                            .collect()
                    });
                    json!({"token": piece, "logprob": g.logprobs[k], "bytes": piece.as_bytes(), "top_logprobs": alternatives})
                })
                .collect();
            json!({"content": content})
        } else {
            Value::Null
        };
        choices.push(json!({
            "index": i, "message": {"role": "assistant", "content": text(&s, &g.tokens)?},
            "logprobs": lp, "finish_reason": finish_reason(g), "token_ids": g.tokens,
        }));
    }
    Ok(Json(json!({
        "id": format!("chatcmpl-{}", rand::random::<u64>()), "object": "chat.completion", "created": now(),
        "model": s.name, "choices": choices, "usage": usage(prompt.len(), &samples),
    })))
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
