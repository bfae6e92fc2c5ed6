//! `POST /v1/chat/completions` (the shared fields in [`super::openai`]).
//!
//! `messages` are rendered with the model's chat template and the generation prompt, as
//! transformers' `apply_chat_template` renders them: `tools` (a list of function schemas) go to the
//! template as its `tools`, `chat_template_kwargs` (e.g. `{"enable_thinking": false}`) as extra
//! variables; `tool` messages and assistant messages with `tool_calls` are passed through (their
//! `function.arguments`, JSON text in OpenAI's form, as the objects templates expect), and a
//! content given as a list of text parts is joined. `max_tokens` (or `max_completion_tokens`)
//! defaults to the rest of the model's context. `logprobs: true` with `top_logprobs: k` (at most
//! 20) lists each token of the reply. An answer also carries `prompt_token_ids` (an extension:
//! the rendered conversation's ids, what a trainer needs beside each choice's `token_ids`).
//!
//! With tools (and `tool_choice` `auto`, the default), the reply is read for tool calls in the
//! model's syntax ([`super::tool_calls`]): found, they are `message.tool_calls` (ids `call_…`,
//! arguments as JSON text), the text before them the content, and `finish_reason` is
//! `tool_calls`; a reply whose call does not parse is content, `finish_reason` `stop`.
//! `tool_choice: "none"` renders no tools and parses nothing; `required` or a named function is
//! refused (the engine does not constrain decoding). Streamed with tools, a choice comes whole in
//! its last chunk (its calls are known only then).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::completions::fail;
use super::jobs::{self, Event};
use super::openai::{self as oa, invalid, OpenAiError};
use super::streaming::{self, TextStream};
use super::tool_calls;
use super::EngineServer;
use crate::rollout::request::Generation;
use crate::rollout::{Request, RequestOutput, SamplingParams};

struct Chat {
    model: String,
    prompt: Vec<u32>,
    params: SamplingParams,
    n: usize,
    /// `top_logprobs` when `logprobs` is on.
    logprobs: Option<usize>,
    /// Replies are read for tool calls.
    tools: bool,
    adapter: Option<String>,
    logit_bias: Vec<(u32, f32)>,
    stream: bool,
    include_usage: bool,
}

pub async fn chat_completions(State(s): State<Arc<EngineServer>>, body: Bytes) -> Response {
    match answer(s, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn answer(s: Arc<EngineServer>, body: &[u8]) -> Result<Response, OpenAiError> {
    let c = Arc::new(parse(&s, body)?);
    let req = Request {
        num_samples: c.n,
        sample_topk: c.logprobs.unwrap_or(0),
        adapter: c.adapter.clone(),
        logit_bias: c.logit_bias.clone(),
        ..Request::new(c.prompt.clone(), c.params.clone())
    };
    if c.stream {
        return Ok(streaming::respond(move |tx| stream(s, c, req, tx)));
    }
    let out = jobs::submit(&s, vec![req], false).outputs().await.map_err(oa::engine_error)?.remove(0);
    let choices = (out.samples.iter().enumerate())
        .map(|(i, g)| Ok(whole_choice(&s, &c, g, i)?.0))
        .collect::<Result<Vec<_>, OpenAiError>>()?;
    let mut body = header(&c, "chat.completion");
    body["choices"] = Value::Array(choices);
    body["usage"] = usage(&c, &out);
    body["prompt_token_ids"] = json!(c.prompt);
    Ok(Json(body).into_response())
}

fn parse(s: &EngineServer, body: &[u8]) -> Result<Chat, OpenAiError> {
    let o = oa::object(body)?;
    let adapter = oa::adapter_of(s, &o)?;
    oa::refuse_unsupported(&o, &[])?;
    if let Some(f) = o.get("response_format").filter(|f| !f.is_null()) {
        if f.get("type").and_then(Value::as_str) != Some("text") {
            return Err(invalid("response_format", "only `response_format` {\"type\": \"text\"} is supported"));
        }
    }
    let messages = o.get("messages").and_then(Value::as_array).filter(|a| !a.is_empty());
    let messages = messages.ok_or_else(|| invalid("messages", "`messages` must be a non-empty list"))?;
    let messages: Vec<Value> = messages.iter().map(template_message).collect::<Result<_, _>>()?;
    let tools = match o.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) if t.is_empty() => None,
        Some(t @ Value::Array(_)) => Some(t),
        Some(_) => return Err(invalid("tools", "`tools` must be a list of tool schemas")),
    };
    let tools = match o.get("tool_choice") {
        None | Some(Value::Null) => tools,
        Some(Value::String(c)) if c == "auto" => tools,
        Some(Value::String(c)) if c == "none" => None,
        Some(other) => {
            return Err(invalid(
                "tool_choice",
                format!("`tool_choice` {other} is not supported (only \"auto\" and \"none\")"),
            ))
        }
    };
    let extra = match o.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(invalid("chat_template_kwargs", "`chat_template_kwargs` must be an object")),
    };
    let rendered = s
        .tokenizer
        .apply_chat_template_with(&messages, true, tools, &extra)
        .map_err(|e| invalid("messages", e.to_string()))?;
    let prompt = s.tokenizer.encode(&rendered, false).map_err(|e| invalid("messages", e.to_string()))?;
    let max_tokens = match oa::uint(&o, "max_completion_tokens")? {
        Some(m) => m,
        None => oa::uint(&o, "max_tokens")?.unwrap_or(s.context.saturating_sub(prompt.len()).max(1)),
    };
    oa::check_prompt(s, "messages", &prompt, max_tokens)?;
    let (params, n) = oa::sampling(&o, max_tokens)?;
    let top = oa::uint(&o, "top_logprobs")?.unwrap_or(0);
    if top > 20 {
        return Err(invalid("top_logprobs", "`top_logprobs` must be at most 20"));
    }
    let (stream, include_usage) = oa::streaming(&o)?;
    Ok(Chat {
        model: o["model"].as_str().unwrap_or_default().to_string(),
        prompt,
        params,
        n,
        logprobs: oa::flag(&o, "logprobs")?.then_some(top),
        tools: tools.is_some(),
        adapter,
        logit_bias: oa::logit_bias(s, &o)?,
        stream,
        include_usage,
    })
}

/// A message as templates take it: text parts joined; tool calls' arguments as objects.
fn template_message(m: &Value) -> Result<Value, OpenAiError> {
    let mut m = m.as_object().cloned().ok_or_else(|| invalid("messages", "each message must be an object"))?;
    if !m.get("role").is_some_and(Value::is_string) {
        return Err(invalid("messages", "each message needs a string `role`"));
    }
    if let Some(Value::Array(parts)) = m.get("content") {
        let mut text = String::new();
        for p in parts {
            match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => text.push_str(t),
                (Some("text"), None) => return Err(invalid("messages", "a `text` content part needs a string `text`")),
                (kind, _) => {
                    return Err(invalid(
                        "messages",
                        format!(
                            "a content part of type `{}` is not supported: the engine takes text only (no image, \
                             audio or video input)",
                            kind.unwrap_or("(none)")
                        ),
                    ))
                }
            }
        }
        m.insert("content".into(), Value::String(text));
    }
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        for call in calls {
            if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
                if let Some(parsed) =
                    f.get("arguments").and_then(Value::as_str).and_then(|a| serde_json::from_str(a).ok())
                {
                    f.insert("arguments".into(), parsed);
                }
            }
        }
    }
    Ok(Value::Object(m))
}

fn header(c: &Chat, object: &str) -> Value {
    json!({"id": format!("chatcmpl-{:016x}", rand::random::<u64>()), "object": object, "created": oa::now(),
           "model": c.model})
}

fn usage(c: &Chat, out: &RequestOutput) -> Value {
    oa::usage(c.prompt.len(), out.samples.iter().map(|g| g.tokens.len()).sum())
}

/// The log-prob entries of sampled tokens `from..` of `g`.
fn entries(s: &EngineServer, g: &Generation, from: usize) -> Vec<Value> {
    (from..g.tokens.len())
        .map(|k| {
            let piece = oa::piece(s, g.tokens[k]);
            let top: Vec<Value> = g.topk.get(k).map_or(vec![], |alts| {
                alts.iter()
                    .map(|(t, l)| {
                        let p = oa::piece(s, *t);
                        json!({"token": p, "logprob": l, "bytes": p.as_bytes()})
                    })
                    .collect()
            });
            json!({"token": piece, "logprob": g.logprobs[k], "bytes": piece.as_bytes(), "top_logprobs": top})
        })
        .collect()
}

/// A choice whole (unstreamed, or streamed with tools): the choice, and its message.
fn whole_choice(s: &EngineServer, c: &Chat, g: &Generation, index: usize) -> Result<(Value, Value), OpenAiError> {
    let text = oa::completion_text(s, g, &c.params.stop_strings)?;
    let parsed = if c.tools { tool_calls::parse(&text) } else { None };
    let (message, finish) = match parsed {
        Some(p) => {
            let calls: Vec<Value> = p
                .calls
                .iter()
                .map(|t| {
                    json!({"id": format!("call_{:016x}", rand::random::<u64>()), "type": "function",
                           "function": {"name": t.name, "arguments": t.arguments}})
                })
                .collect();
            (json!({"role": "assistant", "content": p.content, "tool_calls": calls}), "tool_calls")
        }
        None => (json!({"role": "assistant", "content": text}), oa::finish_reason(g)),
    };
    let lp = c.logprobs.map_or(Value::Null, |_| json!({"content": entries(s, g, 0)}));
    let choice = json!({"index": index, "message": message, "logprobs": lp, "finish_reason": finish,
                        "token_ids": g.tokens});
    Ok((choice, message))
}

/// A streamed answer (see [`super::streaming`]).
async fn stream(s: Arc<EngineServer>, c: Arc<Chat>, req: Request, tx: streaming::Sender) {
    let mut jobs = jobs::submit(&s, vec![req], !c.tools);
    let head = header(&c, "chat.completion.chunk");
    let chunk = |choice: Value| {
        let mut v = head.clone();
        v["choices"] = json!([choice]);
        if c.include_usage {
            v["usage"] = Value::Null;
        }
        tx.chunk(&v)
    };
    for i in 0..c.n {
        if !chunk(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                         "finish_reason": null}))
        {
            return;
        }
    }
    let mut texts: Vec<TextStream> = (0..c.n).map(|_| TextStream::default()).collect();
    let mut completion_tokens = 0;
    loop {
        let event = tokio::select! {
            _ = tx.closed() => return,
            e = jobs.next() => e,
        };
        let sent = match event {
            None => break,
            Some(Event::Delta(_, d)) => {
                let i = d.sample;
                let text = match texts[i].push(&s, &d.tokens, &c.params.stop_strings) {
                    Ok(t) => t,
                    Err(e) => return fail(&tx, e),
                };
                let lp = c.logprobs.map_or(Value::Null, |_| {
                    let g = Generation {
                        tokens: d.tokens.clone(),
                        logprobs: d.logprobs,
                        topk: d.topk,
                        ..Generation::empty()
                    };
                    json!({"content": entries(&s, &g, 0)})
                });
                chunk(json!({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null,
                             "token_ids": d.tokens}))
            }
            Some(Event::Done(_, Ok(out))) => {
                let mut ok = true;
                for (i, g) in out.samples.iter().enumerate() {
                    completion_tokens += g.tokens.len();
                    match last_chunk(&s, &c, g, &mut texts[i], i) {
                        Ok(v) => ok &= chunk(v),
                        Err(e) => return fail(&tx, e),
                    }
                }
                ok
            }
            Some(Event::Done(_, Err(e))) => return fail(&tx, oa::engine_error(e)),
        };
        if !sent {
            return;
        }
    }
    if c.include_usage {
        let mut v = head.clone();
        v["choices"] = json!([]);
        v["usage"] = oa::usage(c.prompt.len(), completion_tokens);
        tx.chunk(&v);
    }
    tx.done();
}

/// A streamed choice's last chunk: with tools the whole reply (content and tool calls), else
/// the tokens not sent yet, the rest of the text and why it ended.
fn last_chunk(
    s: &EngineServer,
    c: &Chat,
    g: &Generation,
    text: &mut TextStream,
    i: usize,
) -> Result<Value, OpenAiError> {
    if c.tools {
        let (choice, message) = whole_choice(s, c, g, i)?;
        let mut delta = json!({"content": message["content"]});
        if let Some(calls) = message["tool_calls"].as_array() {
            let indexed: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(k, call)| {
                    let mut call = call.clone();
                    call["index"] = json!(k);
                    call
                })
                .collect();
            delta["tool_calls"] = Value::Array(indexed);
        }
        return Ok(json!({"index": i, "delta": delta, "logprobs": choice["logprobs"],
                         "finish_reason": choice["finish_reason"], "token_ids": g.tokens}));
    }
    let from = text.tokens();
    let rest = text.finish(&oa::completion_text(s, g, &c.params.stop_strings)?);
    let lp = c.logprobs.map_or(Value::Null, |_| json!({"content": entries(s, g, from)}));
    Ok(json!({"index": i, "delta": {"content": rest}, "logprobs": lp, "finish_reason": oa::finish_reason(g),
              "token_ids": &g.tokens[from..]}))
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    /// Text parts are joined; an image part (a vision-language chat) is refused naming its type.
    #[test]
    fn content_parts_are_text_or_refused_by_type() {
        let m = json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
        assert_eq!(template_message(&m).unwrap()["content"], "ab");
        let image = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}});
        let m = json!({"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]});
        let OpenAiError(status, message, param) = template_message(&m).unwrap_err();
        assert_eq!((status, param.as_deref()), (StatusCode::BAD_REQUEST, Some("messages")));
        assert!(message.contains("`image_url` is not supported") && message.contains("text only"), "{message}");
        let m = json!({"role": "user", "content": [{"type": "text"}]});
        assert!(template_message(&m).unwrap_err().1.contains("needs a string `text`"));
    }
}
