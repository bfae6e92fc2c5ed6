//! A seeded fuzz test of `oxrl serve`: a real server process over a tiny model gets a
//! few thousand mutated requests on every endpoint — JSON bodies with fields dropped, duplicated,
//! retyped, renested; extreme numbers; truncated and garbled JSON and protobuf; random bytes;
//! long and odd unicode strings; other keys' and made-up ids, `../` and `tinker://` paths; wrong
//! content types, methods and keys. No answer may be a 5xx (no faults are injected here), none
//! may take over 10 s, the process must stay up (and log no panic), and a normal training step
//! must still work at the end.
//!
//! The requests come from a small PRNG: `OXRL_FUZZ_SEED=N` (decimal or 0x hex) replays a run,
//! `OXRL_FUZZ_COUNT=N` changes its length, `OXRL_FUZZ_LOG=1` prints every request and its status. A failure prints the seed, the request's index and the
//! request itself.

use crate::common;
use crate::server_protocol::{fwdbwd_body, lora_model, post, request, result};
#[cfg(feature = "failpoints")]
use crate::server_protocol::{post_as, result_as};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use oxrl::server::proto;
use prost::Message;
use serde_json::{json, Value};

/// A request that takes longer than this is a hang.
const TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_SEED: u64 = 0x0c5e_ed25;
const DEFAULT_COUNT: usize = 4000;

/// splitmix64: tiny, seedable, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (0 when n is 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// One HTTP request, as sent (and printed when it fails).
#[derive(Clone)]
struct Req {
    method: String,
    /// The request target, as sent (already percent-encoded where it needs to be).
    path: String,
    key: Option<String>,
    content_type: Option<String>,
    accept_proto: bool,
    body: Vec<u8>,
}

impl Req {
    fn json(method: &str, path: &str, body: Value) -> Req {
        Req {
            method: method.into(),
            path: format!("/api/v1/{path}"),
            key: Some("k1".into()),
            content_type: Some("application/json".into()),
            accept_proto: false,
            body: if body.is_null() { vec![] } else { body.to_string().into_bytes() },
        }
    }

    /// What to paste to replay it: the request line, headers and (the start of) the body.
    fn describe(&self) -> String {
        let mut body = String::from_utf8_lossy(&self.body).into_owned();
        if body.len() > 3000 {
            let cut = (0..=3000).rev().find(|&i| body.is_char_boundary(i)).unwrap_or(0);
            body = format!("{}… ({} bytes in all)", &body[..cut], self.body.len());
        }
        let hex = if std::str::from_utf8(&self.body).is_err() {
            let n = self.body.len().min(512);
            let h: String = self.body[..n].iter().map(|b| format!("{b:02x}")).collect();
            format!("\n  body as hex (first {n} bytes): {h}")
        } else {
            String::new()
        };
        format!(
            "{} {}\n  X-API-Key: {:?}\n  Content-Type: {:?}\n  Accept protobuf: {}\n  body ({} bytes): {:?}{hex}",
            self.method,
            self.path,
            self.key,
            self.content_type,
            self.accept_proto,
            self.body.len(),
            body
        )
    }
}

/// Sends `r`; the status and the body, or why there was none (a hang or a dropped connection).
fn send(port: u16, r: &Req) -> Result<(u16, String), String> {
    send_within(port, r, TIMEOUT)
}

/// [`send`] with another time limit.
fn send_within(port: u16, r: &Req, timeout: Duration) -> Result<(u16, String), String> {
    let start = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("cannot connect: {e}"))?;
    s.set_read_timeout(Some(timeout)).unwrap();
    s.set_write_timeout(Some(timeout)).unwrap();
    let mut head = format!("{} {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n", r.method, r.path);
    if let Some(k) = &r.key {
        head += &format!("X-API-Key: {k}\r\n");
    }
    if let Some(t) = &r.content_type {
        head += &format!("Content-Type: {t}\r\n");
    }
    if r.accept_proto {
        head += "Accept: application/x-protobuf\r\n";
    }
    head += &format!("Content-Length: {}\r\n\r\n", r.body.len());
    s.write_all(head.as_bytes()).map_err(|e| format!("cannot send the head: {e}"))?;
    // The server may answer (400, 413) before reading the whole body: a failed write is fine.
    let _ = s.write_all(&r.body);
    let mut raw = vec![];
    let read = s.read_to_end(&mut raw);
    let elapsed = start.elapsed();
    if elapsed > timeout {
        return Err(format!("no complete answer within {timeout:?} (hang): {elapsed:?}"));
    }
    if let Err(e) = read {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            return Err(format!("no complete answer within {timeout:?} (hang)"));
        }
        if raw.len() < 12 {
            return Err(format!("the connection failed before an answer: {e}"));
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status =
        text.strip_prefix("HTTP/1.1 ").and_then(|t| t.get(..3)).and_then(|s| s.parse().ok()).ok_or_else(|| {
            let start: String = text.chars().take(300).collect();
            format!("not an HTTP answer ({} bytes): {start:?}", raw.len())
        })?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

type Server = common::ServeProcess;

/// `oxrl serve` over a tiny model (hidden 32, 64 positions, seed 3) with keys k1, k2 and a
/// 1 MiB body limit, with these environment variables; returns once `healthz` answers.
fn serve_with(dir: &Path, env: &[(&str, &str)]) -> Server {
    common::ServeProcess::start(dir, (32, 64, 3), &["k1", "k2"], &["--max-body-mib", "1"], env)
}

fn serve(dir: &Path) -> Server {
    serve_with(dir, &[])
}

/// The process runs, answers `healthz`, and has logged no panic.
fn check_alive(server: &mut Server, context: &str) {
    let status = server.child.try_wait().unwrap();
    assert!(status.is_none(), "{context}: the server exited ({status:?}); its log:\n{}", server.log_text());
    let health = Req { key: None, ..Req::json("GET", "healthz", Value::Null) };
    let r = send(server.port, &health);
    assert!(matches!(r, Ok((200, _))), "{context}: healthz answered {r:?}");
    let log = server.log_text();
    assert!(!log.contains("panicked"), "{context}: the server panicked; its log:\n{log}");
}

/// The ids a run starts from; the fuzzer swaps them with each other and with made-up ones.
struct Fixture {
    session: String,
    /// A session of this key's that `sessions/{id}/finish` may end (not `session`).
    spare_session: String,
    /// Key k2's session and model (404 for k1).
    other_session: String,
    other_model: String,
    model: String,
    sampler: String,
    weights: String,
    sampler_weights: String,
    done_future: String,
}

impl Fixture {
    /// Strings that an id field may be given instead of the right one.
    fn bad_ids(&self) -> Vec<String> {
        let long = "x".repeat(5000);
        vec![
            self.other_session.clone(),
            self.other_model.clone(),
            self.session.clone(),
            self.model.clone(),
            self.sampler.clone(),
            self.weights.clone(),
            self.sampler_weights.clone(),
            self.done_future.clone(),
            format!("{}:train:999", self.session),
            format!("{}:sample:999", self.session),
            format!("{}:sample:0", self.other_session),
            "base:tiny".into(),
            "base:../tiny".into(),
            format!("path:{}", self.weights),
            format!("path:{}", self.sampler_weights),
            "path:tinker://../../etc/weights/passwd".into(),
            "../../../etc/passwd".into(),
            "..".into(),
            "/".into(),
            "".into(),
            ":".into(),
            "::".into(),
            ":train:".into(),
            "tinker://".into(),
            "tinker:///weights/".into(),
            format!("tinker://{}/weights/..", self.model),
            format!("tinker://{}/weights/../../../x", self.model),
            format!("tinker://{}/sampler_weights/%2e%2e", self.model),
            format!("tinker://{}/bogus/x", self.model),
            format!("tinker://{}/weights/fz", self.other_model),
            format!("tinker://{}/weights/fz/extra", self.model),
            "tinker://a/weights/b\u{0}c".into(),
            "file:///etc/passwd".into(),
            "/etc/passwd".into(),
            "é∂😀\u{202e}".into(),
            long,
        ]
    }
}

/// A valid request for each endpoint (one picked at random per mutation).
const ENDPOINTS: usize = 34;

fn template(f: &Fixture, rng: &mut Rng, which: usize, seq: i64) -> Req {
    let m = f.model.as_str();
    let tokens: Vec<u32> = b"hi there".iter().map(|&b| b as u32).collect();
    let ckpt = |kind: &str, name: &str| format!("training_runs/{m}/checkpoints/{kind}/{name}");
    match which {
        0 => Req { key: None, ..Req::json("GET", "healthz", Value::Null) },
        1 => Req::json("GET", "get_server_capabilities", Value::Null),
        2 => Req::json("POST", "client/config", json!({"sdk_version": "0.38.0"})),
        3 => Req::json("POST", "client/dynamic_config", json!({})),
        4 => Req::json("POST", "cancel_future", json!({"request_id": f.done_future})),
        5 => Req::json("POST", "telemetry", json!({"events": [{"event": "x", "severity": "INFO"}], "platform": "t"})),
        6 => Req::json(
            "POST",
            "create_session",
            json!({"tags": ["fuzz"], "user_metadata": {"a": 1}, "sdk_version": "0.38.0", "type": "create_session"}),
        ),
        7 => Req::json("POST", "session_heartbeat", json!({"session_id": f.session})),
        8 => Req::json("POST", &format!("sessions/{}/finish", f.spare_session), json!({})),
        9 => Req::json("GET", "sessions?limit=5&offset=0", Value::Null),
        10 => Req::json("GET", &format!("sessions/{}", f.session), Value::Null),
        11 => Req::json(
            "POST",
            "create_model",
            json!({"session_id": f.session, "model_seq_id": 1 + rng.below(1_000_000), "base_model": "tiny",
                   "lora_config": {"rank": 2, "seed": 1, "train_attn": true, "train_mlp": false, "train_unembed": false},
                   "optimizer_config": {"type": "adamw"}, "user_metadata": {"run": "fuzz"}}),
        ),
        12 => Req::json("POST", "get_info", json!({"model_id": m})),
        13 => Req::json("POST", "forward_backward", fwdbwd_body(m, seq, "cross_entropy")),
        14 => {
            let loss = *rng.pick(&["cross_entropy", "importance_sampling", "ppo"]);
            let mut b = fwdbwd_body(m, seq, loss);
            if let Some(d) = b["forward_backward_input"]["data"][0]["loss_fn_inputs"].as_object_mut() {
                d.insert("logprobs".into(), json!({"data": vec![-1.0; tokens.len() - 1], "dtype": "float32"}));
                d.insert("advantages".into(), json!({"data": vec![0.5; tokens.len() - 1], "dtype": "float32"}));
            }
            Req::json("POST", "forward_backward", b)
        }
        15 => Req { content_type: Some("application/x-protobuf".into()), ..proto_req(m, seq, &tokens) },
        16 => {
            let mut b = fwdbwd_body(m, seq, "cross_entropy");
            b["forward_input"] = b["forward_backward_input"].take();
            Req::json("POST", "forward", b)
        }
        17 => Req::json(
            "POST",
            "optim_step",
            json!({"model_id": m, "seq_id": seq,
                   "adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                                   "weight_decay": 0.0, "grad_clip_norm": 1.0}}),
        ),
        18 => Req::json(
            "POST",
            "save_weights",
            json!({"model_id": m, "path": format!("fz{}", rng.below(4)), "seq_id": seq, "overwrite": true,
                   "ttl_seconds": 3600}),
        ),
        19 => Req::json(
            "POST",
            "load_weights",
            json!({"model_id": m, "seq_id": seq, "path": f.weights, "optimizer": rng.chance(50)}),
        ),
        20 => Req::json(
            "POST",
            "load_weights",
            json!({"session_id": f.session, "model_seq_id": 1_000_000 + rng.below(1_000_000), "path": f.weights,
                   "optimizer": false}),
        ),
        21 => Req::json("POST", "weights_info", json!({"tinker_path": f.weights})),
        22 => Req::json(
            "POST",
            "save_weights_for_sampler",
            if rng.chance(50) {
                json!({"model_id": m, "path": format!("fzs{}", rng.below(4)), "seq_id": seq, "ttl_seconds": 3600})
            } else {
                json!({"model_id": m, "sampling_session_seq_id": 100 + rng.below(8), "seq_id": seq})
            },
        ),
        23 => Req::json(
            "POST",
            "create_sampling_session",
            if rng.chance(50) {
                json!({"session_id": f.session, "sampling_session_seq_id": 10 + rng.below(20), "base_model": "tiny"})
            } else {
                json!({"session_id": f.session, "sampling_session_seq_id": 10 + rng.below(20),
                       "model_path": f.sampler_weights})
            },
        ),
        24 => Req::json("GET", &format!("samplers/{}", f.sampler), Value::Null),
        25 => Req::json(
            "POST",
            "asample",
            json!({"sampling_session_id": f.sampler, "num_samples": 1 + rng.below(3),
                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                   "sampling_params": {"max_tokens": 1 + rng.below(4), "seed": 7, "temperature": 0.7, "top_k": -1,
                                       "top_p": 0.9, "stop": [10]},
                   "prompt_logprobs": true, "topk_prompt_logprobs": 2, "topk_sample_logprobs": 1,
                   "prompt_logprobs_last_n": 3}),
        ),
        26 => Req::json("GET", "training_runs?limit=3&offset=0", Value::Null),
        27 => Req::json("GET", &format!("training_runs/{m}"), Value::Null),
        28 => Req::json("GET", &format!("training_runs/{m}/checkpoints"), Value::Null),
        29 => Req::json("DELETE", &ckpt("weights", &format!("gone{}", rng.below(3))), Value::Null),
        30 => {
            let method = *rng.pick(&["POST", "DELETE"]);
            Req::json(method, &format!("{}/publish", ckpt("sampler_weights", "fzs")), json!({}))
        }
        31 => Req::json("PUT", &format!("{}/ttl", ckpt("weights", "fz")), json!({"ttl_seconds": 3600})),
        32 => Req::json("GET", "checkpoints?limit=10", Value::Null),
        _ => Req::json("POST", "retrieve_future", json!({"request_id": f.done_future, "allow_metadata_only": false})),
    }
}

fn proto_message(model: &str, seq: i64, tokens: &[u32]) -> proto::ForwardBackwardRequest {
    let ints = |v: &[u32]| v.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect::<Vec<u8>>();
    let dense = |bytes: Vec<u8>, dtype: proto::DType, n: usize| proto::Tensor {
        encoding: Some(proto::tensor::Encoding::Dense(bytes)),
        dtype: dtype as i32,
        shape: vec![n as i64],
    };
    let n = tokens.len() - 1;
    let targets: Vec<u8> = tokens[1..].iter().flat_map(|&t| (t as i64).to_le_bytes()).collect();
    let weights: Vec<u8> = (0..n).flat_map(|_| 1f32.to_le_bytes()).collect();
    proto::ForwardBackwardRequest {
        model_id: model.into(),
        seq_id: seq as i32,
        data: vec![proto::Datum {
            model_input: vec![proto::Chunk {
                chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk { tokens: ints(&tokens[..n]) })),
            }],
            loss_fn_inputs: [
                ("target_tokens".to_string(), dense(targets, proto::DType::Int64, n)),
                ("weights".to_string(), dense(weights, proto::DType::Float32, n)),
            ]
            .into(),
            // Provenance (tiling checked for every loss), so that mutations reach its parsing.
            model_input_spans: vec![prompt_span(0, n)],
            loss_fn_input_spans: vec![prompt_span(1, n)],
        }],
        loss_fn: "cross_entropy".into(),
        ..Default::default()
    }
}

/// A run of `length` prompt tokens from `offset` of a (never recorded) sequence.
fn prompt_span(offset: i64, length: usize) -> proto::ProvenanceSpan {
    let run = proto::SpanRun { sequence_id: "fuzz-sequence".into(), offset, length: length as i64 };
    proto::ProvenanceSpan { span: Some(proto::provenance_span::Span::PromptTokens(run)) }
}

fn proto_req(model: &str, seq: i64, tokens: &[u32]) -> Req {
    Req {
        body: proto_message(model, seq, tokens).encode_to_vec(),
        accept_proto: true,
        ..Req::json("POST", "forward_backward", Value::Null)
    }
}

/// A path to a node of a JSON value.
type NodePath = Vec<Result<String, usize>>;

fn node_paths(v: &Value, at: &mut NodePath, out: &mut Vec<NodePath>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                at.push(Ok(k.clone()));
                node_paths(c, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate().take(8) {
                at.push(Err(i));
                node_paths(c, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn node_mut<'a>(v: &'a mut Value, path: &NodePath) -> &'a mut Value {
    let mut v = v;
    for seg in path {
        v = match seg {
            Ok(k) => &mut v[k.as_str()],
            Err(i) => &mut v[*i],
        };
    }
    v
}

/// A random node's path; `filter` picks which kinds of node (any when none matches).
fn random_node(rng: &mut Rng, v: &Value, filter: impl Fn(&Value, &NodePath) -> bool) -> NodePath {
    let mut all = vec![];
    node_paths(v, &mut vec![], &mut all);
    let matching: Vec<NodePath> = all
        .iter()
        .filter(|p| {
            let mut c = v;
            for seg in p.iter() {
                c = match seg {
                    Ok(k) => &c[k.as_str()],
                    Err(i) => &c[*i],
                };
            }
            filter(c, p)
        })
        .cloned()
        .collect();
    if matching.is_empty() {
        rng.pick(&all).clone()
    } else {
        rng.pick(&matching).clone()
    }
}

/// Number texts JSON may carry (some past what serde or the fields accept; `NaN` and `Infinity`
/// are not JSON at all).
const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "-0.0",
    "-1",
    "1",
    "0.5",
    "-1e-320",
    "1e308",
    "-1e308",
    "1.7976931348623157e308",
    "1e309",
    "1e400",
    "-1e400",
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "2147483647",
    "2147483648",
    "-2147483649",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "123456789012345678901234567890",
    "1.0",
    "1e2",
    "01",
    "0x10",
    "+1",
    ".5",
];

const STRINGS: &[&str] = &[
    "",
    " ",
    "\u{0}",
    "é∂😀",
    "\u{202e}reversed",
    "\u{feff}bom",
    "\u{fffd}\u{ffff}",
    "a\nb\tc\"d\\e",
    "tiny",
    "tiny\u{0}",
    "TINY",
    "adamw",
    "sgd",
    "cross_entropy",
    "ppo",
    "dro",
    "importance_sampling",
    "encoded_text",
    "image",
    "int64",
    "float32",
    "bfloat16",
    "null",
    "true",
    "-1",
    "1e308",
    "NaN",
    "%00",
    "%2e%2e%2f",
    "../../etc/passwd",
    "tinker://",
    "weights",
    "sampler_weights",
];

/// Raw JSON texts that are invalid as strings (lone surrogates) or deep.
fn raw_texts() -> Vec<String> {
    vec![
        r#""\ud800""#.into(),
        r#""\udc00x""#.into(),
        r#""\u0000""#.into(),
        r#""\x41""#.into(),
        format!("{}1{}", "[".repeat(200), "]".repeat(200)),
        format!("{}{}", "{\"a\":".repeat(200), format!("1{}", "}".repeat(200))),
        "[]".into(),
        "{}".into(),
        "null".into(),
        "true".into(),
        "[null, 1, \"x\", {}]".into(),
    ]
}

fn random_value(rng: &mut Rng) -> Value {
    match rng.below(9) {
        0 => Value::Null,
        1 => json!(rng.chance(50)),
        2 => json!(rng.next() as i64),
        3 => json!((rng.next() as i64) >> rng.below(64)),
        4 => {
            // Any finite double (JSON has no NaN or infinities).
            let x = f64::from_bits(rng.next());
            json!(if x.is_finite() { x } else { -0.0 })
        }
        5 => json!(*rng.pick(STRINGS)),
        6 => json!([rng.below(300), -1, "x"]),
        7 => json!({"type": "encoded_text", "tokens": [1, 2]}),
        _ => json!([]),
    }
}

/// A string that stands in a value's place until it is swapped for raw text after serializing.
const RAW: &str = "@@raw@@";

/// Mutates a JSON body, in place or as text; returns a label of what it did.
fn mutate_json(rng: &mut Rng, f: &Fixture, body: &mut Value, raw: &mut Option<String>) -> &'static str {
    match rng.below(14) {
        0 => {
            // Drop a field.
            let p = random_node(rng, body, |v, _| v.as_object().is_some_and(|m| !m.is_empty()));
            if let Some(m) = node_mut(body, &p).as_object_mut() {
                if let Some(k) = m.keys().nth(rng.below(m.len())).cloned() {
                    m.remove(&k);
                }
            }
            "drop a field"
        }
        1 => {
            // Retype a value.
            let p = random_node(rng, body, |_, p| !p.is_empty());
            *node_mut(body, &p) = random_value(rng);
            "retype a value"
        }
        2 => {
            // An extreme number (or not a number) in a numeric place, as raw text.
            let p = random_node(rng, body, |v, _| v.is_number());
            *node_mut(body, &p) = json!(RAW);
            *raw = Some(rng.pick(NUMBERS).to_string());
            "extreme number"
        }
        3 => {
            // An extreme number anywhere.
            let p = random_node(rng, body, |_, p| !p.is_empty());
            *node_mut(body, &p) = json!(RAW);
            *raw = Some(rng.pick(NUMBERS).to_string());
            "number anywhere"
        }
        4 => {
            // Wrong nesting: wrap a value, or unwrap an object / array.
            let p = random_node(rng, body, |_, _| true);
            let node = node_mut(body, &p);
            let old = node.take();
            *node = match rng.below(4) {
                0 => json!([old]),
                1 => json!({"value": old}),
                2 => old.as_object().and_then(|m| m.values().next().cloned()).unwrap_or(json!([[old]])),
                _ => old.as_array().and_then(|a| a.first().cloned()).unwrap_or(json!({"data": old})),
            };
            "wrong nesting"
        }
        5 => {
            // A long string.
            let p = random_node(rng, body, |v, _| v.is_string());
            let unit = *rng.pick(&["a", "é", "😀", "/", "../", "\u{0}"]);
            *node_mut(body, &p) = json!(unit.repeat(*rng.pick(&[300, 5_000, 70_000, 150_000])));
            "long string"
        }
        6 => {
            // An odd string.
            let p = random_node(rng, body, |v, _| v.is_string());
            *node_mut(body, &p) = json!(*rng.pick(STRINGS));
            "odd string"
        }
        7 => {
            // Raw invalid or deep text in a place.
            let p = random_node(rng, body, |_, p| !p.is_empty());
            *node_mut(body, &p) = json!(RAW);
            *raw = Some(rng.pick(&raw_texts()).clone());
            "raw text"
        }
        8 => {
            // An id (or path) field gets someone else's or a made-up one.
            let ids =
                ["session_id", "model_id", "request_id", "path", "tinker_path", "sampling_session_id", "model_path"];
            let p = random_node(rng, body, |v, p| {
                v.is_string() && matches!(p.last(), Some(Ok(k)) if ids.contains(&k.as_str()))
            });
            *node_mut(body, &p) = json!(rng.pick(&f.bad_ids()).clone());
            "invalid id"
        }
        9 => {
            // A big array (token lists capped to what is cheap to refuse or run).
            let p = random_node(rng, body, |v, _| v.is_array());
            let n = *rng.pick(&[0, 1, 63, 64, 65, 300, 2_000]);
            let node = node_mut(body, &p);
            let first = node.as_array().and_then(|a| a.first().cloned()).unwrap_or(json!(1));
            *node = Value::Array((0..n).map(|i| if i % 7 == 3 { json!(i % 256) } else { first.clone() }).collect());
            "big array"
        }
        10 => {
            // An extra unknown field, or a known one twice (in place).
            let p = random_node(rng, body, |v, _| v.is_object());
            if let Some(m) = node_mut(body, &p).as_object_mut() {
                m.insert(format!("extra_{}", rng.below(100)), random_value(rng));
            }
            "extra field"
        }
        11 => {
            // Negative / zero / huge integers in the integer places.
            let p = random_node(rng, body, |v, _| v.is_i64() || v.is_u64());
            *node_mut(body, &p) = json!(*rng.pick(&[0i64, -1, -2, i64::MIN, i64::MAX, 1 << 31, 1 << 32, 63, 64, 65]));
            "edge integer"
        }
        12 => {
            // The body is something else entirely.
            *body = random_value(rng);
            "other body"
        }
        _ => {
            // Null in a place.
            let p = random_node(rng, body, |_, p| !p.is_empty());
            *node_mut(body, &p) = Value::Null;
            "null value"
        }
    }
}

/// Mutations of the text or bytes of a body.
fn mutate_bytes(rng: &mut Rng, body: &mut Vec<u8>) -> &'static str {
    match rng.below(6) {
        0 => {
            let n = rng.below(body.len() + 1);
            body.truncate(n);
            "truncated"
        }
        1 => {
            for _ in 0..1 + rng.below(4) {
                if body.is_empty() {
                    break;
                }
                let i = rng.below(body.len());
                body[i] ^= 1 << rng.below(8);
            }
            "bit flips"
        }
        2 => {
            let i = rng.below(body.len() + 1);
            let n = 1 + rng.below(16);
            let junk = rng.bytes(n);
            let tail = body.split_off(i);
            body.extend(junk);
            body.extend(tail);
            "inserted bytes"
        }
        3 => {
            if !body.is_empty() {
                let i = rng.below(body.len());
                let n = 1 + rng.below((body.len() - i).min(16));
                body.drain(i..i + n);
            }
            "deleted bytes"
        }
        4 => {
            let n = rng.below(600);
            *body = rng.bytes(n);
            "random bytes"
        }
        _ => {
            body.clear();
            "empty body"
        }
    }
}

/// Mutations of the protobuf forward_backward message's fields.
fn mutate_proto(rng: &mut Rng, f: &Fixture, msg: &mut proto::ForwardBackwardRequest) -> &'static str {
    let d = &mut msg.data[0];
    match rng.below(12) {
        0 => {
            msg.seq_id = *rng.pick(&[0, -1, i32::MIN, i32::MAX, 2, 1_000_000]);
            "proto seq_id"
        }
        1 => {
            msg.model_id = rng.pick(&f.bad_ids()).clone();
            "proto model_id"
        }
        2 => {
            msg.loss_fn = rng.pick(STRINGS).to_string();
            "proto loss_fn"
        }
        3 => {
            let cfg = [("clip_low_threshold", f64::NAN), ("clip_high_threshold", f64::INFINITY), ("beta", -1e308)];
            let (k, v) = *rng.pick(&cfg);
            msg.loss_fn_config.insert(k.into(), v);
            msg.loss_fn_config_v2.insert(
                rng.pick(&["beta", "x", ""]).to_string(),
                proto::LossConfigValue { value: Some(proto::loss_config_value::Value::Text("é".into())) },
            );
            "proto loss config"
        }
        4 => {
            // Token bytes: odd length, negative or huge ids, too many.
            let bytes = match rng.below(4) {
                0 => vec![1, 2, 3],
                1 => (-5i32).to_le_bytes().to_vec(),
                2 => i32::MAX.to_le_bytes().to_vec(),
                _ => {
                    (0..*rng.pick(&[64usize, 65, 300, 2_000])).flat_map(|i| ((i % 200) as i32).to_le_bytes()).collect()
                }
            };
            d.model_input = vec![proto::Chunk {
                chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk { tokens: bytes })),
            }];
            "proto tokens"
        }
        5 => {
            d.model_input.push(proto::Chunk {
                chunk: Some(if rng.chance(50) {
                    proto::chunk::Chunk::Image(vec![0xff; 10])
                } else {
                    proto::chunk::Chunk::Dmel(vec![])
                }),
            });
            if rng.chance(50) {
                d.model_input.push(proto::Chunk { chunk: None });
            }
            "proto chunk kind"
        }
        6 => {
            let name = rng.pick(&["weights", "target_tokens", "advantages", "bogus", ""]).to_string();
            let t = d.loss_fn_inputs.entry(name).or_default();
            t.dtype = *rng.pick(&[0, 1, 2, 3, 4, 99, -1]);
            "proto dtype"
        }
        7 => {
            let name = rng.pick(&["weights", "target_tokens"]).to_string();
            let t = d.loss_fn_inputs.entry(name).or_default();
            t.encoding = match rng.below(4) {
                0 => Some(proto::tensor::Encoding::Dense(vec![1, 2, 3, 4, 5])),
                1 => Some(proto::tensor::Encoding::Dense(f32::NAN.to_le_bytes().repeat(7))),
                2 => Some(proto::tensor::Encoding::SparseCsr(proto::SparseCsr::default())),
                _ => None,
            };
            "proto tensor bytes"
        }
        8 => {
            for t in d.loss_fn_inputs.values_mut() {
                t.shape = vec![*rng.pick(&[-1i64, 0, i64::MAX, i64::MIN]), 3];
            }
            "proto shape"
        }
        9 => {
            msg.data = match rng.below(3) {
                0 => vec![],
                1 => vec![proto::Datum::default()],
                _ => vec![msg.data[0].clone(); 40],
            };
            "proto data count"
        }
        10 => {
            d.loss_fn_inputs.clear();
            msg.forward_only = rng.chance(50);
            "proto no loss inputs"
        }
        _ => {
            let t = d.loss_fn_inputs.entry("target_tokens".into()).or_default();
            t.encoding = Some(proto::tensor::Encoding::Dense(
                [-1i64, 1 << 40, i64::MAX].iter().cycle().take(7).flat_map(|v| v.to_le_bytes()).collect(),
            ));
            "proto target ids"
        }
    }
}

/// Raw protobuf bytes that lie about lengths or use unknown fields and wire types.
fn proto_junk(rng: &mut Rng, body: &mut Vec<u8>) -> &'static str {
    match rng.below(4) {
        0 => {
            // Field 3 (data), length-delimited, with a length far past the end.
            body.extend([0x1a, 0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2]);
            "proto long length"
        }
        1 => {
            // An unknown field with a 10-byte varint.
            body.extend([0x78, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
            "proto unknown field"
        }
        2 => {
            // Field 2 (seq_id) as a length-delimited field (wrong wire type).
            body.extend([0x12, 0x02, 0x01, 0x02]);
            "proto wrong wire type"
        }
        _ => {
            // Group start without an end, or a deprecated wire type.
            body.extend(*rng.pick(&[&[0x0b_u8][..], &[0x0c], &[0x0f], &[0x07, 0x00]]));
            "proto bad wire type"
        }
    }
}

const CONTENT_TYPES: &[&str] = &[
    "application/json",
    "application/x-protobuf",
    "text/plain",
    "application/json; charset=utf-16",
    "multipart/form-data; boundary=x",
    "application/x-www-form-urlencoded",
    "*/*",
    "",
];

const METHODS: &[&str] = &["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "FOO"];

/// Percent-encodes what may not stand in a request target as is.
fn encode_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Mutations of the method, path, headers of a request.
fn mutate_envelope(rng: &mut Rng, f: &Fixture, r: &mut Req) -> &'static str {
    match rng.below(7) {
        0 => {
            r.method = rng.pick(METHODS).to_string();
            "wrong method"
        }
        1 => {
            r.content_type = match *rng.pick(CONTENT_TYPES) {
                "" => None,
                t => Some(t.to_string()),
            };
            r.accept_proto = rng.chance(50);
            "wrong content type"
        }
        2 => {
            r.key = rng.pick(&[None, Some("k2"), Some("nope"), Some(""), Some("k1 ")]).map(String::from);
            "other key"
        }
        3 => {
            // A path segment (after /api/v1/) swapped for an id or garbage.
            let rest = r.path.trim_start_matches("/api/v1/").to_string();
            let (route, query) =
                rest.split_once('?').map(|(a, b)| (a.to_string(), Some(b))).unwrap_or((rest.clone(), None));
            let mut segs: Vec<String> = route.split('/').map(String::from).collect();
            let i = rng.below(segs.len());
            // The fuzzed session is not finished midway (that frees the model the run trains).
            let ids: Vec<String> =
                f.bad_ids().into_iter().filter(|id| !route.contains("finish") || *id != f.session).collect();
            let id = rng.pick(&ids).clone();
            segs[i] =
                if rng.chance(70) { encode_segment(&id) } else { id.replace(|c: char| !c.is_ascii_graphic(), "") };
            r.path = format!("/api/v1/{}{}", segs.join("/"), query.map(|q| format!("?{q}")).unwrap_or_default());
            "path segment"
        }
        4 => {
            let q = rng.pick(&[
                "limit=-1",
                "limit=1e308&offset=-0",
                "offset=18446744073709551616",
                "limit=18446744073709551615&offset=18446744073709551615",
                "limit=&offset=",
                "limit",
                "&&&=",
                "limit=%FF",
                "limit=0",
            ]);
            let base = r.path.split('?').next().unwrap().to_string();
            r.path = format!("{base}?{q}");
            "query"
        }
        5 => {
            let suffix = rng.pick(&["/", "//", "/x", "/../healthz", "/%2e%2e/healthz", "%00", "/..", "?", "#x"]);
            r.path = format!("{}{suffix}", r.path.split('?').next().unwrap());
            "path suffix"
        }
        _ => {
            let prefixes = ["/api/v2/", "/api/", "/", "//api/v1/", "/api/v1//", "/API/V1/", "/api/v1/../v1/"];
            let rest = r.path.trim_start_matches("/api/v1/").to_string();
            r.path = format!("{}{rest}", rng.pick(&prefixes));
            "path prefix"
        }
    }
}

/// The templates that take a seq_id slot of the model.
const TAKES_SEQ: [usize; 8] = [13, 14, 15, 16, 17, 18, 19, 22];

/// Whether the endpoint of template `which` reads the request body.
fn reads_body(which: usize) -> bool {
    !matches!(which, 0..=3 | 5 | 8..=10 | 24 | 26..=30 | 32)
}

/// The next request of the run: a template, mutated (or, one time in twenty, not).
fn fuzz_request(rng: &mut Rng, f: &Fixture, seq: i64) -> (Req, String, usize) {
    let which = rng.below(ENDPOINTS);
    let mut r = template(f, rng, which, seq);
    if rng.below(20) == 0 {
        return (r, format!("endpoint {which}, unmutated"), which);
    }
    let mut done = vec![];
    let rounds = 1 + rng.below(3).saturating_sub(1);
    for _ in 0..rounds {
        let is_proto = r.content_type.as_deref() == Some("application/x-protobuf") && which == 15;
        // Endpoints that read no body get mostly method, path and header mutations.
        let kind = if reads_body(which) || rng.chance(20) { rng.below(10) } else { 7 };
        let label = if kind < 5 && is_proto {
            if rng.chance(70) {
                let mut msg = proto::ForwardBackwardRequest::decode(r.body.as_slice())
                    .unwrap_or_else(|_| proto_message(&f.model, seq, &[104, 105, 32]));
                if msg.data.is_empty() {
                    msg.data.push(proto::Datum::default());
                }
                let l = mutate_proto(rng, f, &mut msg);
                r.body = msg.encode_to_vec();
                l
            } else {
                proto_junk(rng, &mut r.body)
            }
        } else if kind < 5 {
            let mut v: Value = serde_json::from_slice(&r.body).unwrap_or(json!({}));
            let mut raw = None;
            let l = mutate_json(rng, f, &mut v, &mut raw);
            let mut text = v.to_string();
            if let Some(raw) = raw {
                text = text.replacen(&format!("\"{RAW}\""), &raw, 1);
            }
            r.body = text.into_bytes();
            l
        } else if kind < 7 {
            if kind == 6 && !is_proto {
                // A field twice, as text (serde refuses a struct's duplicate field).
                if let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(&r.body) {
                    if let Some((k, v)) = m.iter().nth(rng.below(m.len().max(1))) {
                        let dup = if rng.chance(50) { v.clone() } else { random_value(rng) };
                        let text = String::from_utf8_lossy(&r.body).into_owned();
                        let text = text.replacen('{', &format!("{{{}:{dup},", json!(k)), 1);
                        r.body = text.into_bytes();
                    }
                }
                "duplicate field"
            } else {
                mutate_bytes(rng, &mut r.body)
            }
        } else {
            mutate_envelope(rng, f, &mut r)
        };
        done.push(label);
    }
    (r, format!("endpoint {which}, {}", done.join(" + ")), which)
}

/// The `(model_id, seq_id)` a request would take a slot of, if it names one.
fn seq_slot(r: &Req) -> Option<(String, i64)> {
    // As the server reads it: protobuf only on the two forward routes.
    let route = r.path.split(['?', '#']).next().unwrap_or_default();
    let proto_route = ["/api/v1/forward_backward", "/api/v1/forward"].contains(&route);
    if proto_route && r.content_type.as_deref().is_some_and(|t| t.starts_with("application/x-protobuf")) {
        let m = proto::ForwardBackwardRequest::decode(r.body.as_slice()).ok()?;
        return Some((m.model_id, m.seq_id as i64));
    }
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    Some((v.get("model_id")?.as_str()?.to_string(), v.get("seq_id")?.as_i64()?))
}

fn env_number(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
    .or_else(|| panic!("{name}={v} is not a number"))
}

/// Waits for a future of the fixture and returns its result (it must succeed).
fn done(port: u16, r: &crate::server_protocol::Reply) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.body["request_id"].as_str().unwrap().to_string();
    let out = result(port, &id);
    assert!(out.get("error").is_none(), "{out}");
    (id, out)
}

#[test]
fn fuzzed_requests_get_no_5xx_no_hang_and_no_crash() {
    let seed = env_number("OXRL_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    let count = env_number("OXRL_FUZZ_COUNT").map(|c| c as usize).unwrap_or(DEFAULT_COUNT);
    println!("server fuzz: seed {seed:#x} ({count} requests; replay with OXRL_FUZZ_SEED={seed:#x})");
    let dir = tempfile::tempdir().unwrap();
    let mut server = serve(dir.path());
    let port = server.port;

    // The fixture: a model with a state and a sampler checkpoint, a sampler, key k2's session
    // and model, a spare session, a finished future.
    let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let (session, model) = lora_model(port, lora.clone());
    let r = post(port, "save_weights", json!({"model_id": model, "path": "fz", "seq_id": 1}));
    let (done_future, out) = done(port, &r);
    let weights = out["path"].as_str().unwrap().to_string();
    let r = post(port, "save_weights_for_sampler", json!({"model_id": model, "path": "fzs", "seq_id": 2}));
    let sampler_weights = done(port, &r).1["path"].as_str().unwrap().to_string();
    let r = post(
        port,
        "create_sampling_session",
        json!({"session_id": session, "sampling_session_seq_id": 0, "model_path": sampler_weights}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let sampler = r.body["sampling_session_id"].as_str().unwrap().to_string();
    let spare_session = post(port, "create_session", json!({})).body["session_id"].as_str().unwrap().to_string();
    let k2 = |path: &str, body: Value| request(port, "POST", &format!("/api/v1/{path}"), Some("k2"), &body.to_string());
    let other_session = k2("create_session", json!({})).body["session_id"].as_str().unwrap().to_string();
    let r = k2(
        "create_model",
        json!({"session_id": other_session, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let other_model = r.body["model_id"].as_str().unwrap().to_string();
    let f = Fixture {
        session,
        spare_session,
        other_session,
        other_model,
        model,
        sampler,
        weights,
        sampler_weights,
        done_future,
    };

    let verbose = std::env::var_os("OXRL_FUZZ_LOG").is_some();
    let mut rng = Rng(seed);
    // The model's next free seq_id: valid templates take it, so that some fuzzed requests run.
    let mut next_seq = 3;
    let start = Instant::now();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    // Accepted requests whose futures must end (not queued behind a seq_id gap): what they were
    // and their request ids, checked after the fuzzing.
    let mut accepted = vec![];
    for index in 0..count {
        let (req, what, which) = fuzz_request(&mut rng, &f, next_seq);
        let context = || format!("seed {seed:#x}, request {index} ({what}):\n{}", req.describe());
        let (status, answer) = match send(port, &req) {
            Ok((status, answer)) => {
                assert!(status < 500, "{status} for {}\nanswer: {answer}", context());
                // Honest categories: a refused fuzzed request is the caller's doing.
                let category = serde_json::from_str::<Value>(&answer).ok().map(|a| a["category"].clone());
                assert_ne!(category, Some(json!("server")), "a server error for {}\nanswer: {answer}", context());
                (status, answer)
            }
            Err(e) => panic!("{e} for {}\nserver log:\n{}", context(), server.log_text()),
        };
        *statuses.entry(status).or_default() += 1;
        if verbose {
            let body: String = String::from_utf8_lossy(&req.body).chars().take(160).collect();
            let path: String = req.path.chars().take(120).collect();
            println!("{index} {status} [{what}] {} {path} {body:?}", req.method);
        }
        let slot = seq_slot(&req);
        let runs = status == 200 && slot == Some((f.model.clone(), next_seq));
        if runs {
            next_seq += 1;
        }
        // (A request of a seq_id template whose slot cannot be told may wait behind a gap.)
        if status == 200 && (runs || (slot.is_none() && !TAKES_SEQ.contains(&which))) {
            let answer: Value = serde_json::from_str(&answer).unwrap_or_default();
            if let Some(id) = answer.get("request_id").and_then(Value::as_str) {
                accepted.push((id.to_string(), req.key.clone(), context()));
            }
        }
        if index % 100 == 99 {
            check_alive(&mut server, &format!("seed {seed:#x}, after request {index}"));
        }
    }
    let fuzz_time = start.elapsed();
    check_alive(&mut server, &format!("seed {seed:#x}, after the fuzzing"));

    // Every accepted request's future ends, in a result or a user error: a server error there is
    // a fault the HTTP status did not show (a worker's panic, say). The model's queue may still
    // be working through the fuzzed steps: a future may take a long poll (30 s) or two.
    let check = Instant::now();
    for (id, key, context) in &accepted {
        let r = Req { key: key.clone(), ..Req::json("POST", "retrieve_future", json!({"request_id": id})) };
        let out = loop {
            let out = match send_within(port, &r, Duration::from_secs(40)) {
                Ok((200, answer)) => serde_json::from_str::<Value>(&answer).unwrap_or_default(),
                other => panic!("retrieve_future {id}: {other:?}, for {context}"),
            };
            if out["type"] != "try_again" {
                break out;
            }
            let log = server.log_text();
            assert!(
                check.elapsed() < Duration::from_secs(90),
                "the future {id} did not end, for {context}\nlog:\n{log}"
            );
        };
        assert_ne!(out["category"], "server", "a server error {out} for {context}");
    }
    let check_time = check.elapsed();
    println!(
        "server fuzz: {count} requests in {fuzz_time:.1?}, statuses {statuses:?}, {} slots run, {} futures \
         ended ({check_time:.1?})",
        next_seq - 3,
        accepted.len()
    );

    // A normal training step still works, on a new model (the fuzzed session is finished first,
    // so that its models do not count against this key's limit).
    let r = post(port, &format!("sessions/{}/finish", f.session), json!({}));
    assert_eq!(r.status, 200, "seed {seed:#x}: {}", r.body);
    let (_, model) =
        lora_model(port, json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false}));
    let out = done(port, &post(port, "forward_backward", fwdbwd_body(&model, 1, "cross_entropy"))).1;
    let loss = out["metrics"]["loss:sum"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "seed {seed:#x}: {out}");
    let adam = json!({"learning_rate": 0.01});
    let out = done(port, &post(port, "optim_step", json!({"model_id": model, "seq_id": 2, "adam_params": adam}))).1;
    assert!(out["metrics"]["grad_norm:mean"].as_f64().unwrap() > 0.0, "seed {seed:#x}: {out}");
    check_alive(&mut server, &format!("seed {seed:#x}, at the end"));
}

/// A panic in one training model's worker thread (injected: `OXRL_FAILPOINT_PANIC`, cargo
/// feature `failpoints`) fails that model's requests with a server error, and the process and
/// another tenant's model serve on: the other key trains a step with the loss of a fresh server.
#[cfg(feature = "failpoints")]
#[test]
fn a_panicking_worker_fails_only_its_model() {
    fn call(port: u16, key: &str, path: &str, body: Value) -> Value {
        let r = post_as(port, key, path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        r.body
    }
    /// create_model `n` in a new session of `key`, forward_backward, optim_step (all submitted
    /// before any is awaited, as the SDK pipelines them): their outcomes.
    fn train_step(port: u16, key: &str, n: u64) -> Vec<Value> {
        let session =
            call(port, key, "create_session", json!({"tags": []}))["session_id"].as_str().unwrap().to_string();
        let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
        let body = json!({"session_id": session, "model_seq_id": n, "base_model": "tiny", "lora_config": lora});
        let created = call(port, key, "create_model", body);
        let model = format!("{session}:train:{n}");
        let fb = call(port, key, "forward_backward", fwdbwd_body(&model, 1, "cross_entropy"));
        let adam = json!({"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8});
        let step = call(port, key, "optim_step", json!({"model_id": model, "seq_id": 2, "adam_params": adam}));
        [created, fb, step].iter().map(|r| result_as(port, key, r["request_id"].as_str().unwrap())).collect()
    }
    crate::server_protocol::expect_server_faults();
    let dir = tempfile::tempdir().unwrap();
    // Worker threads are `oxrl-{session}:train:{n}-{rank}`: model 7 of any session panics.
    let mut server = serve_with(dir.path(), &[("OXRL_FAILPOINT_PANIC", ":train:7-")]);
    let failed = train_step(server.port, "k1", 7);
    let server_errors = failed.iter().filter(|o| o["category"] == "server").count();
    assert!(server_errors >= 2, "model 7's requests did not fail with server errors: {failed:?}");
    assert!(failed.iter().all(|o| o["metrics"].is_null()), "model 7 trained: {failed:?}");
    assert!(server.log_text().contains("injected panic"), "{}", server.log_text());
    // Another key's model beside it trains as on a fresh server.
    let ok = train_step(server.port, "k2", 0);
    let fresh_dir = tempfile::tempdir().unwrap();
    let fresh = serve(fresh_dir.path());
    let expected = train_step(fresh.port, "k2", 0);
    assert!(ok[1]["metrics"]["loss:sum"].as_f64().is_some_and(f64::is_finite), "{ok:?}");
    assert_eq!(ok[1]["metrics"]["loss:sum"], expected[1]["metrics"]["loss:sum"]);
    assert_eq!(ok[2]["metrics"], expected[2]["metrics"]);
    let status = server.child.try_wait().unwrap();
    assert!(status.is_none(), "the server exited ({status:?}); its log:\n{}", server.log_text());
}
