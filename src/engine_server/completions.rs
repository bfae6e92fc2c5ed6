//! `POST /v1/completions`: what lm-evaluation-harness's `local-completions` and other
//! completion clients send (the shared fields in [`super::openai`]).
//!
//! `prompt` is a string, a list of token ids, or a list of either (one engine request each, run
//! together); each prompt gets `n` choices, choice `index` = prompt × n + sample. `max_tokens`
//! defaults to 16 and may be 0 (with `echo`: scoring only). `logprobs: k` (at most 20) lists each
//! token's text, log-prob, the k most likely tokens (a text → log-prob map) and text offsets.
//! `echo` puts the prompt before the completion — its text (the string given, or its ids
//! decoded), and with `logprobs` its tokens' log-probs, `null` for the first, as vLLM: the
//! engine's prompt log-probs, the bits `oxrl score` and the trainer compute for those tokens.
//! A top log-prob entry of a token has exactly its log-prob's bits, so clients that compare the
//! two (lm-eval's greedy check) see equality. Refused: `suffix`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::jobs::{self, Event};
use super::openai::{self as oa, invalid, OpenAiError};
use super::streaming::{self, TextStream};
use super::EngineServer;
use crate::rollout::request::{Generation, TopLogprobs};
use crate::rollout::{Request, RequestOutput, SamplingParams};

/// A parsed completion request.
struct Completion {
    model: String,
    prompts: Vec<Vec<u32>>,
    /// The prompt as given when it was a string (what `echo` returns).
    texts: Vec<Option<String>>,
    params: SamplingParams,
    n: usize,
    echo: bool,
    logprobs: Option<usize>,
    adapter: Option<String>,
    logit_bias: Vec<(u32, f32)>,
    stream: bool,
    include_usage: bool,
}

pub async fn completions(State(s): State<Arc<EngineServer>>, body: Bytes) -> Response {
    match answer(s, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn answer(s: Arc<EngineServer>, body: &[u8]) -> Result<Response, OpenAiError> {
    let c = Arc::new(parse(&s, body)?);
    let reqs = requests(&c);
    if c.stream {
        return Ok(streaming::respond(move |tx| stream(s, c, reqs, tx)));
    }
    let outs = jobs::submit(&s, reqs, false).outputs().await.map_err(oa::engine_error)?;
    let mut choices = vec![];
    for (p, out) in outs.iter().enumerate() {
        for (j, g) in out.samples.iter().enumerate() {
            choices.push(choice(&s, &c, p, out, g, p * c.n + j)?);
        }
    }
    let mut body = header(&c, "cmpl");
    body["choices"] = Value::Array(choices);
    body["usage"] = usage(&c, &outs);
    Ok(Json(body).into_response())
}

fn parse(s: &EngineServer, body: &[u8]) -> Result<Completion, OpenAiError> {
    let o = oa::object(body)?;
    let adapter = oa::adapter_of(s, &o)?;
    oa::refuse_unsupported(&o, &["suffix"])?;
    let (prompts, texts) = prompts(s, o.get("prompt"))?;
    let max_tokens = oa::uint(&o, "max_tokens")?.unwrap_or(16);
    for p in &prompts {
        oa::check_prompt(s, "prompt", p, max_tokens)?;
    }
    let (params, n) = oa::sampling(&o, max_tokens)?;
    let logprobs = oa::uint(&o, "logprobs")?;
    if logprobs.is_some_and(|k| k > 20) {
        return Err(invalid("logprobs", "`logprobs` must be at most 20"));
    }
    let (stream, include_usage) = oa::streaming(&o)?;
    Ok(Completion {
        model: o["model"].as_str().unwrap_or_default().to_string(),
        prompts,
        texts,
        params,
        n,
        echo: oa::flag(&o, "echo")?,
        logprobs,
        adapter,
        logit_bias: oa::logit_bias(s, &o)?,
        stream,
        include_usage,
    })
}

/// Each prompt's token ids, and its text when it was given as a string.
type Prompts = (Vec<Vec<u32>>, Vec<Option<String>>);

/// The prompts: a string, token ids, or a non-empty list of strings or of token-id lists.
fn prompts(s: &EngineServer, v: Option<&Value>) -> Result<Prompts, OpenAiError> {
    let encode = |t: &str| s.tokenizer.encode(t, true).map_err(|e| invalid("prompt", e.to_string()));
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|v| v.as_u64().filter(|&t| t <= u32::MAX as u64).map(|t| t as u32)).collect()
    };
    let bad = || {
        invalid("prompt", "`prompt` must be a string, a list of token ids, or a list of strings or of token-id lists")
    };
    match v {
        Some(Value::String(t)) => Ok((vec![encode(t)?], vec![Some(t.clone())])),
        Some(Value::Array(a)) if a.is_empty() => Err(invalid("prompt", "`prompt` is an empty list")),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Ok((vec![ids(a).ok_or_else(bad)?], vec![None])),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            let texts: Vec<String> = a.iter().map(|v| v.as_str().unwrap_or_default().to_string()).collect();
            Ok((texts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?, texts.into_iter().map(Some).collect()))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => {
            let lists: Option<Vec<Vec<u32>>> = a.iter().map(|v| v.as_array().and_then(|l| ids(l))).collect();
            let lists = lists.ok_or_else(bad)?;
            let n = lists.len();
            Ok((lists, vec![None; n]))
        }
        None | Some(Value::Null) => Err(invalid("prompt", "`prompt` is required")),
        Some(_) => Err(bad()),
    }
}

fn requests(c: &Completion) -> Vec<Request> {
    let k = c.logprobs.unwrap_or(0);
    c.prompts
        .iter()
        .map(|p| Request {
            num_samples: c.n,
            prompt_logprobs: c.echo && c.logprobs.is_some(),
            prompt_topk: if c.echo { k } else { 0 },
            sample_topk: k,
            adapter: c.adapter.clone(),
            logit_bias: c.logit_bias.clone(),
            ..Request::new(p.clone(), c.params.clone())
        })
        .collect()
}

fn header(c: &Completion, prefix: &str) -> Value {
    json!({"id": format!("{prefix}-{:016x}", rand::random::<u64>()), "object": "text_completion",
           "created": oa::now(), "model": c.model})
}

/// Each prompt's tokens once, every sampled token.
fn usage(c: &Completion, outs: &[RequestOutput]) -> Value {
    let prompt: usize = c.prompts.iter().map(Vec::len).sum();
    let completion: usize = outs.iter().flat_map(|o| &o.samples).map(|g| g.tokens.len()).sum();
    oa::usage(prompt, completion)
}

/// The log-prob listing of `tokens`: texts, log-probs, top maps and offsets from `offset`
/// (advanced past them).
fn listing(
    s: &EngineServer,
    tokens: &[u32],
    logprobs: &[Option<f32>],
    top: &[Option<&TopLogprobs>],
    offset: &mut usize,
) -> Value {
    let pieces: Vec<String> = tokens.iter().map(|&t| oa::piece(s, t)).collect();
    let offsets: Vec<usize> = pieces
        .iter()
        .map(|p| {
            let at = *offset;
            *offset += p.chars().count();
            at
        })
        .collect();
    let top: Vec<Value> = top.iter().map(|t| t.map_or(Value::Null, |t| oa::top_map(s, t))).collect();
    json!({"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// Joins two listings.
fn join(a: Value, b: Value) -> Value {
    let mut out = serde_json::Map::new();
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        let mut list = a[key].as_array().cloned().unwrap_or_default();
        list.extend(b[key].as_array().cloned().unwrap_or_default());
        out.insert(key.into(), Value::Array(list));
    }
    Value::Object(out)
}

/// The echoed prompt: its text, its listing when log-probs are asked for, and the text offset
/// after it.
fn echo_part(
    s: &EngineServer,
    c: &Completion,
    p: usize,
    out: &RequestOutput,
) -> Result<(String, Value, usize), OpenAiError> {
    let prompt = &c.prompts[p];
    let text = match &c.texts[p] {
        Some(t) => t.clone(),
        None => s.tokenizer.decode(prompt, false).map_err(oa::engine_error)?,
    };
    let mut offset = 0;
    let lp = match c.logprobs {
        None => Value::Null,
        Some(_) => {
            let scored = out.prompt_logprobs.clone().unwrap_or_default();
            let lps: Vec<Option<f32>> = std::iter::once(None).chain(scored.into_iter().map(Some)).collect();
            let tops: Vec<Option<&TopLogprobs>> = match &out.prompt_topk {
                Some(t) => std::iter::once(None).chain(t.iter().map(Some)).collect(),
                None => vec![None; prompt.len()],
            };
            listing(s, prompt, &lps[..prompt.len()], &tops[..prompt.len()], &mut offset)
        }
    };
    Ok((text, lp, offset))
}

/// The listing of sampled tokens `from..` of `g`.
fn sampled_listing(s: &EngineServer, g: &Generation, from: usize, offset: &mut usize) -> Value {
    let lps: Vec<Option<f32>> = g.logprobs[from..].iter().map(|&l| Some(l)).collect();
    let tops: Vec<Option<&TopLogprobs>> = (from..g.tokens.len()).map(|i| g.topk.get(i)).collect();
    listing(s, &g.tokens[from..], &lps, &tops, offset)
}

/// One unstreamed choice.
fn choice(
    s: &EngineServer,
    c: &Completion,
    p: usize,
    out: &RequestOutput,
    g: &Generation,
    index: usize,
) -> Result<Value, OpenAiError> {
    let completion = oa::completion_text(s, g, &c.params.stop_strings)?;
    let (mut text, mut lp, mut offset) = match c.echo {
        true => echo_part(s, c, p, out)?,
        false => (String::new(), Value::Null, 0),
    };
    text.push_str(&completion);
    if c.logprobs.is_some() {
        let sampled = sampled_listing(s, g, 0, &mut offset);
        lp = if lp.is_null() { sampled } else { join(lp, sampled) };
    }
    Ok(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": oa::finish_reason(g),
              "token_ids": g.tokens}))
}

/// A streamed answer (see [`super::streaming`]). With `echo` each choice comes whole in one
/// chunk when its request ends (the prompt's log-probs come with the request's output).
async fn stream(s: Arc<EngineServer>, c: Arc<Completion>, reqs: Vec<Request>, tx: streaming::Sender) {
    let mut jobs = jobs::submit(&s, reqs, !c.echo);
    let head = header(&c, "cmpl");
    let mut texts: Vec<TextStream> = (0..c.prompts.len() * c.n).map(|_| TextStream::default()).collect();
    let mut offsets = vec![0usize; texts.len()];
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    let chunk = |choice: Value| {
        let mut v = head.clone();
        v["choices"] = json!([choice]);
        if c.include_usage {
            v["usage"] = Value::Null;
        }
        tx.chunk(&v)
    };
    loop {
        let event = tokio::select! {
            _ = tx.closed() => return,
            e = jobs.next() => e,
        };
        let sent = match event {
            None => break,
            Some(Event::Delta(p, d)) => {
                let i = p * c.n + d.sample;
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
                    sampled_listing(&s, &g, 0, &mut offsets[i])
                });
                chunk(json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null, "token_ids": d.tokens}))
            }
            Some(Event::Done(p, Ok(out))) => {
                prompt_tokens += c.prompts[p].len();
                let mut ok = true;
                for (j, g) in out.samples.iter().enumerate() {
                    completion_tokens += g.tokens.len();
                    let i = p * c.n + j;
                    let piece = if c.echo {
                        choice(&s, &c, p, &out, g, i)
                    } else {
                        finish(&s, &c, g, &mut texts[i], &mut offsets[i], i)
                    };
                    match piece {
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
        v["usage"] = oa::usage(prompt_tokens, completion_tokens);
        tx.chunk(&v);
    }
    tx.done();
}

/// A streamed choice's last chunk: the tokens it has not sent, the rest of its text, why it ended.
fn finish(
    s: &EngineServer,
    c: &Completion,
    g: &Generation,
    text: &mut TextStream,
    offset: &mut usize,
    index: usize,
) -> Result<Value, OpenAiError> {
    let from = text.tokens();
    let final_text = oa::completion_text(s, g, &c.params.stop_strings)?;
    let rest = text.finish(&final_text);
    let lp = c.logprobs.map_or(Value::Null, |_| sampled_listing(s, g, from, offset));
    Ok(json!({"index": index, "text": rest, "logprobs": lp, "finish_reason": oa::finish_reason(g),
              "token_ids": &g.tokens[from..]}))
}

/// An error inside a stream: one chunk saying so, then the end.
pub fn fail(tx: &streaming::Sender, e: OpenAiError) {
    tx.chunk(&json!({"error": {"message": e.1, "type": "server_error", "param": e.2, "code": null}}));
    tx.done();
}
