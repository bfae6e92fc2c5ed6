//! The Tinker protocol at the HTTP level, without the SDK: request ordering by seq_id, repeated
//! requests, long-poll and `try_again`, JSON forward_backward (older SDKs), errors and API keys.
//! The server runs in-process on loopback.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use oxrl::server::{state, ServerConfig};
use serde_json::{json, Value};

pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) body: Value,
}

pub(crate) fn request(port: u16, method: &str, path: &str, key: Option<&str>, body: &str) -> Reply {
    request_typed(port, method, path, key, "application/json", body.as_bytes())
}

fn request_typed(port: u16, method: &str, path: &str, key: Option<&str>, content_type: &str, body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let key = key.map(|k| format!("X-API-Key: {k}\r\n")).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\n{key}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    // The server may answer (413) before reading a large body: a failed write is fine.
    let _ = s.write_all(body);
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw[9..12].parse().unwrap();
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    let body = serde_json::from_str(body).unwrap_or(Value::String(body.to_string()));
    // The sweep of honest error categories: every request these tests refuse (directly or in
    // its future, read through here too) is the caller's doing, so none may be reported as
    // the server's fault — unless the test broke the server on purpose.
    if !SERVER_FAULTS_EXPECTED.get() {
        assert_ne!(body["category"], "server", "{method} {path}: a refusal reported as the server's fault: {body}");
    }
    Reply { status, body }
}

thread_local! {
    /// Set by a test that breaks the server on purpose (files removed behind its back, a
    /// worker made to panic): its `server` errors are honest.
    static SERVER_FAULTS_EXPECTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// For the rest of the calling test: `server` errors are expected (see [`request`]'s sweep).
pub(crate) fn expect_server_faults() {
    SERVER_FAULTS_EXPECTED.set(true);
}

pub(crate) fn post(port: u16, path: &str, body: Value) -> Reply {
    post_as(port, "k1", path, body)
}

/// [`post`] with API key `key`.
pub(crate) fn post_as(port: u16, key: &str, path: &str, body: Value) -> Reply {
    request(port, "POST", &format!("/api/v1/{path}"), Some(key), &body.to_string())
}

/// Polls a future until it is not `try_again`.
pub(crate) fn result(port: u16, request_id: &str) -> Value {
    result_as(port, "k1", request_id)
}

/// [`result`] with API key `key`.
pub(crate) fn result_as(port: u16, key: &str, request_id: &str) -> Value {
    loop {
        let body = json!({"request_id": request_id, "allow_metadata_only": false});
        let r = post_as(port, key, "retrieve_future", body);
        assert_eq!(r.status, 200, "{}", r.body);
        if r.body["type"] != "try_again" {
            return r.body;
        }
    }
}

/// A model's calls in seq_id order from 1, as one SDK client makes them: each posted with the
/// model's id and the next seq_id (accepted, 200), its outcome awaited.
pub(crate) struct ModelCalls {
    port: u16,
    key: String,
    model_id: String,
    seq: i64,
}

impl ModelCalls {
    pub(crate) fn new(port: u16, key: &str, model_id: &str) -> Self {
        ModelCalls { port, key: key.into(), model_id: model_id.into(), seq: 0 }
    }

    /// POSTs `body` (with `model_id` and the next `seq_id`) to `path`; the future's outcome.
    pub(crate) fn call(&mut self, path: &str, mut body: Value) -> Value {
        self.seq += 1;
        body["model_id"] = json!(self.model_id);
        body["seq_id"] = json!(self.seq);
        let r = post_as(self.port, &self.key, path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        result_as(self.port, &self.key, r.body["request_id"].as_str().unwrap())
    }
}

fn serve(dir: &std::path::Path, long_poll: Duration) -> u16 {
    serve_context(dir, long_poll, 64)
}

/// A server over a tiny model with `max_position` positions.
fn serve_context(dir: &std::path::Path, long_poll: Duration, max_position: usize) -> u16 {
    serve_limited(dir, long_poll, max_position, Default::default())
}

fn serve_limited(
    dir: &std::path::Path,
    long_poll: Duration,
    max_position: usize,
    limits: oxrl::server::limits::Limits,
) -> u16 {
    let model = dir.join("tiny");
    common::tiny_byte_model(&model, 32, max_position, 3);
    std::fs::write(dir.join("keys"), "# test keys\nk1\nk2\n").unwrap();
    let config = ServerConfig {
        models: vec![model],
        host: "127.0.0.1".into(),
        port: 0,
        data_dir: dir.join("data"),
        api_keys: Some(dir.join("keys")),
        threads: 1,
        body_limit: 1 << 20,
        long_poll,
        session_timeout: Duration::from_millis(1500),
        limits,
        drain: Duration::from_secs(5),
        public_url: None,
    };
    let state = state(&config).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            oxrl::server::spawn_session_reaper(state.clone());
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            oxrl::server::serve(listener, state).await.unwrap();
        });
    });
    port
}

/// A new session of key k1 with a training model of `lora`, built: (session id, model id).
pub(crate) fn lora_model(port: u16, lora: Value) -> (String, String) {
    let session = post(port, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let body = json!({"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora});
    let r = post(port, "create_model", body);
    assert_eq!(r.status, 200, "{}", r.body);
    result(port, r.body["request_id"].as_str().unwrap());
    let model_id = format!("{session}:train:0");
    (session, model_id)
}

pub(crate) fn fwdbwd_body(model_id: &str, seq_id: i64, loss_fn: &str) -> Value {
    let tokens: Vec<u32> = b"hello there".iter().map(|&b| b as u32).collect();
    json!({
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {
            "data": [{
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[..tokens.len() - 1]}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": tokens[1..], "dtype": "int64"},
                    "weights": {"data": vec![1.0; tokens.len() - 1], "dtype": "float32"}
                }
            }],
            "loss_fn": loss_fn,
            "loss_fn_config": null
        }
    })
}

#[test]
fn protocol_ordering_errors_and_keys() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));

    // Keys: healthz is open; anything else needs a listed key.
    assert_eq!(request(port, "GET", "/api/v1/healthz", None, "").status, 200);
    assert_eq!(request(port, "GET", "/api/v1/get_server_capabilities", None, "").status, 401);
    assert_eq!(request(port, "GET", "/api/v1/get_server_capabilities", Some("nope"), "").status, 401);
    let caps = request(port, "GET", "/api/v1/get_server_capabilities", Some("k1"), "");
    assert_eq!(caps.body["supported_models"][0]["model_name"], "tiny");

    // Malformed bodies are 400 user errors naming the problem; a body over the limit is a 413.
    let r =
        request_typed(port, "POST", "/api/v1/forward_backward", Some("k1"), "application/x-protobuf", b"\xff\xff\xff");
    assert_eq!((r.status, r.body["category"].as_str()), (400, Some("user")), "{}", r.body);
    assert!(r.body["error"].as_str().unwrap().contains("malformed protobuf"), "{}", r.body);
    let big = vec![b' '; 2 << 20];
    let r = request_typed(port, "POST", "/api/v1/create_session", Some("k1"), "application/json", &big);
    assert_eq!(r.status, 413);
    let r = request(port, "POST", "/api/v1/create_session", Some("k1"), "{not json");
    assert_eq!((r.status, r.body["category"].as_str()), (400, Some("user")), "{}", r.body);
    let r = post(port, "create_model", json!({"session_id": "x"}));
    assert_eq!(r.status, 400);
    assert!(r.body["error"].as_str().unwrap().contains("model_seq_id"), "{}", r.body);

    let session = post(port, "create_session", json!({"tags": [], "sdk_version": "test", "type": "create_session"}));
    let session_id = session.body["session_id"].as_str().unwrap().to_string();
    assert_eq!(post(port, "session_heartbeat", json!({"session_id": session_id})).status, 200);

    // Unknown base model, nothing to train: user errors.
    let r = post(port, "create_model", json!({"session_id": session_id, "model_seq_id": 0, "base_model": "huge"}));
    assert_eq!(r.status, 400);
    assert!(r.body["error"].as_str().unwrap().contains("huge"), "{}", r.body);
    let off = json!({"rank": 4, "train_attn": false, "train_mlp": false, "train_unembed": false});
    let r = post(
        port,
        "create_model",
        json!({"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": off}),
    );
    assert_eq!(r.status, 400, "{}", r.body);

    // Another key cannot use this session.
    let r =
        request(port, "POST", "/api/v1/session_heartbeat", Some("k2"), &json!({"session_id": session_id}).to_string());
    assert_eq!(r.status, 404);

    let lora = json!({"rank": 4, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let r = post(
        port,
        "create_model",
        json!({"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let model_id = format!("{session_id}:train:0");
    assert_eq!(r.body["model_id"], model_id.as_str());
    // Requests sent in reverse seq_id order, before the model is even built: 3 forward,
    // 2 optim_step, 1 forward_backward. They must run 1, 2, 3.
    let mut fwd = fwdbwd_body(&model_id, 3, "cross_entropy");
    fwd["forward_input"] = fwd["forward_backward_input"].take();
    let f3 = post(port, "forward", fwd);
    let adam = json!({"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12});
    let f2 = post(port, "optim_step", json!({"model_id": model_id, "seq_id": 2, "adam_params": adam}));
    let f1 = post(port, "forward_backward", fwdbwd_body(&model_id, 1, "cross_entropy"));
    // A repeated (model_id, seq_id) returns the original future.
    let again = post(port, "optim_step", json!({"model_id": model_id, "seq_id": 2, "adam_params": adam}));
    assert_eq!(again.body["request_id"], f2.body["request_id"]);
    assert_eq!(result(port, r.body["request_id"].as_str().unwrap())["model_id"], model_id.as_str());

    let out1 = result(port, f1.body["request_id"].as_str().unwrap());
    let step = result(port, f2.body["request_id"].as_str().unwrap());
    let out3 = result(port, f3.body["request_id"].as_str().unwrap());
    let grad_norm = step["metrics"]["grad_norm:mean"].as_f64().unwrap();
    assert!(grad_norm > 0.0, "optim_step ran before forward_backward: {step}");
    let (loss1, loss3) = (out1["metrics"]["loss:sum"].as_f64().unwrap(), out3["metrics"]["loss:sum"].as_f64().unwrap());
    assert!(loss3 < loss1, "the forward did not see the step: {loss1} -> {loss3}");
    // loss:sum equals Σ −logprob (weights 1), from the JSON output.
    let lp: Vec<f64> = out1["loss_fn_outputs"][0]["logprobs"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(lp.len(), 10);
    assert!((loss1 + lp.iter().sum::<f64>()).abs() < 1e-4 * loss1, "{loss1} vs {lp:?}");

    // A used seq_id, an unknown loss (its future fails in turn), an unknown input key.
    let r = post(port, "forward_backward", fwdbwd_body(&model_id, 1, "cross_entropy"));
    assert_eq!(r.body["request_id"], f1.body["request_id"], "a repeat of seq 1 is the same future");
    let bad = post(port, "forward_backward", fwdbwd_body(&model_id, 4, "ppo_typo"));
    let failed = result(port, bad.body["request_id"].as_str().unwrap());
    assert_eq!(failed["category"], "user", "{failed}");
    assert!(failed["error"].as_str().unwrap().contains("ppo_typo"), "{failed}");
    let mut body = fwdbwd_body(&model_id, 5, "cross_entropy");
    body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["wieghts"] = json!({"data": [1.0]});
    let r = post(port, "forward_backward", body);
    assert_eq!(r.status, 400);
    assert!(r.body["error"].as_str().unwrap().contains("wieghts"), "{}", r.body);
    // Seq 5 was not consumed by the rejected request: a token id out of range fails seq 5's future.
    let mut body = fwdbwd_body(&model_id, 5, "cross_entropy");
    body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]["data"][0] = json!(100000);
    let r = post(port, "forward_backward", body);
    let failed = result(port, r.body["request_id"].as_str().unwrap());
    assert_eq!(failed["category"], "user", "{failed}");

    // Long-poll: a future waiting on a missing seq_id answers try_again after the long-poll time.
    let waiting = post(port, "optim_step", json!({"model_id": model_id, "seq_id": 7}));
    let r = post(port, "retrieve_future", json!({"request_id": waiting.body["request_id"]}));
    assert_eq!(r.body["type"], "try_again", "{}", r.body);
    let r = post(port, "retrieve_future", json!({"request_id": "nope"}));
    assert_eq!(r.status, 404);

    // get_info, checkpoint names.
    let info = post(port, "get_info", json!({"model_id": model_id}));
    assert_eq!(
        (info.body["model_data"]["model_name"].as_str(), info.body["lora_rank"].as_u64()),
        (Some("tiny"), Some(4))
    );
    let r = post(port, "save_weights", json!({"model_id": model_id, "seq_id": 6, "path": "../escape"}));
    let failed = result(port, r.body["request_id"].as_str().unwrap());
    assert!(failed["error"].as_str().unwrap().contains("invalid checkpoint name"), "{failed}");
    let r = post(port, "get_info", json!({"model_id": "nope"}));
    assert_eq!(r.status, 404);

    // TTL and publishing: a checkpoint saved with ttl_seconds 1 is gone after it; a published
    // checkpoint is readable with another key (not changeable by it), private again after unpublish.
    let save = |seq: i64, extra: Value| {
        let mut body = json!({"model_id": model_id, "seq_id": seq});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r = post(port, "save_weights", body);
        result(port, r.body["request_id"].as_str().unwrap())["path"].as_str().unwrap().to_string()
    };
    let brief = save(8, json!({"path": "brief", "ttl_seconds": 1}));
    let kept = save(9, json!({"path": "kept"}));
    let info = |key: &str, path: &str| {
        request(port, "POST", "/api/v1/weights_info", Some(key), &json!({"tinker_path": path}).to_string()).status
    };
    let at = |what: &str| format!("/api/v1/training_runs/{model_id}/checkpoints/weights/kept/{what}");
    let listed = || {
        let r = request(port, "GET", &format!("/api/v1/training_runs/{model_id}/checkpoints"), Some("k1"), "");
        r.body["checkpoints"].as_array().unwrap().clone()
    };
    assert_eq!((info("k1", &brief), info("k1", &kept), info("k2", &kept)), (200, 200, 404));
    assert_eq!(request(port, "POST", &at("publish"), Some("k2"), "").status, 404);
    assert_eq!(request(port, "POST", &at("publish"), Some("k1"), "").status, 200);
    assert_eq!(info("k2", &kept), 200);
    assert!(listed().iter().any(|c| c["checkpoint_id"] == "weights/kept" && c["public"] == true));
    assert_eq!(request(port, "DELETE", &at("publish"), Some("k1"), "").status, 200);
    assert_eq!(info("k2", &kept), 404);
    let r = request(port, "PUT", &at("ttl"), Some("k1"), &json!({"ttl_seconds": 7200}).to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let expiry =
        |cs: Vec<Value>| cs.into_iter().find(|c| c["checkpoint_id"] == "weights/kept").unwrap()["expires_at"].clone();
    let left = expiry(listed()).as_f64().unwrap() - oxrl::server::store::now();
    assert!((7190.0..=7200.0).contains(&left), "{left}");
    request(port, "PUT", &at("ttl"), Some("k1"), &json!({"ttl_seconds": null}).to_string());
    assert!(expiry(listed()).is_null());
    assert_eq!(request(port, "PUT", &at("ttl"), Some("k1"), &json!({"ttl_seconds": 0}).to_string()).status, 400);
    // (Heartbeats around the wait keep the session within its 1.5 s timeout.)
    let beat = || assert_eq!(post(port, "session_heartbeat", json!({"session_id": session_id})).status, 200);
    beat();
    std::thread::sleep(Duration::from_millis(1100));
    beat();
    assert_eq!(info("k1", &brief), 404, "expired checkpoint still readable");
    assert!(!listed().iter().any(|c| c["checkpoint_id"] == "weights/brief"));

    // A session whose heartbeats stop is finished after the timeout (1.5 s here), its models freed.
    let quiet = post(port, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let r = post(
        port,
        "create_model",
        json!({"session_id": quiet, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora}),
    );
    result(port, r.body["request_id"].as_str().unwrap());
    let quiet_model = format!("{quiet}:train:0");
    assert_eq!(post(port, "get_info", json!({"model_id": quiet_model})).status, 200);
    for _ in 0..5 {
        // The other session keeps sending heartbeats: it stays.
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(post(port, "session_heartbeat", json!({"session_id": session_id})).status, 200);
    }
    assert_eq!(post(port, "get_info", json!({"model_id": quiet_model})).status, 404);
    assert_eq!(post(port, "get_info", json!({"model_id": model_id})).status, 200);

    // Finishing the session frees its models: they are unknown afterwards.
    let r = post(port, &format!("sessions/{session_id}/finish"), json!({"reason": {"type": "user"}, "detail": ""}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(post(port, "get_info", json!({"model_id": model_id})).status, 404);

    // A finished session (by the client or for want of heartbeats) takes no new model or sampler:
    // nothing would free them (found by server_fuzz: `{session}:train:0` created again, never freed).
    for session in [&session_id, &quiet] {
        let body = json!({"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora});
        let r = post(port, "create_model", body);
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body["error"].as_str().unwrap().contains("is finished"), "{}", r.body);
        let body = json!({"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"});
        let r = post(port, "create_sampling_session", body);
        assert_eq!(r.status, 400, "{}", r.body);
    }
    assert_eq!(post(port, "get_info", json!({"model_id": model_id})).status, 404);
}

/// A future pending when the server died reports an error after the restart instead of hanging.
/// The calls whose handlers need no body keep their connection for the next when the body
/// arrives after the headers (see [`common::late_bodies_keep_the_connection`]).
#[test]
fn calls_without_a_body_to_read_keep_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let calls: [(&str, &[u8]); 3] = [
        ("/api/v1/client/config", b"{}"),
        ("/api/v1/client/dynamic_config", b"{}"),
        ("/api/v1/telemetry", b"{\"events\": []}"),
    ];
    let headers = "content-type: application/json\r\nx-api-key: k1\r\n";
    common::late_bodies_keep_the_connection(&format!("127.0.0.1:{port}"), headers, &calls, "/api/v1/healthz");
}

#[test]
fn cancel_future_ends_a_pending_sample() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve_context(dir.path(), Duration::from_millis(300), 4096);
    let flags = post(port, "client/dynamic_config", json!({"sdk_version": "test"}));
    assert_eq!(flags.body["sample_cancel_enabled"], true, "{}", flags.body);
    let session = post(port, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let s = post(
        port,
        "create_sampling_session",
        json!({"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}),
    );
    let sampler = s.body["sampling_session_id"].as_str().unwrap().to_string();
    let sample = |max_tokens: usize| {
        let r = post(
            port,
            "asample",
            json!({
                "sampling_session_id": sampler, "seq_id": 0, "num_samples": 64,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]},
                "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "stop": []}
            }),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.body["request_id"].as_str().unwrap().to_string()
    };
    // 64 × 4,000 tokens take seconds; the cancel arrives within milliseconds.
    let long = sample(4000);
    let t = std::time::Instant::now();
    assert_eq!(post(port, "cancel_future", json!({"request_id": long})).status, 200);
    let out = result(port, &long);
    assert!(out["error"].as_str().unwrap().contains("cancelled"), "{out}");
    assert_eq!(out["category"], "user");
    assert!(t.elapsed() < Duration::from_secs(2), "cancel took {:?}", t.elapsed());
    // Cancelling a finished future changes nothing; an unknown one is 404.
    let short = sample(3);
    let done = result(port, &short);
    assert_eq!(post(port, "cancel_future", json!({"request_id": short})).status, 200);
    assert_eq!(result(port, &short), done);
    assert_eq!(post(port, "cancel_future", json!({"request_id": "nope"})).status, 404);
}

#[test]
fn pending_futures_fail_after_a_restart() {
    use oxrl::server::store::{Store, StoredOutcome, RESTART_ERROR};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("server.sqlite");
    {
        let store = Store::open(&path).unwrap();
        store.add_future("done", None, "optim_step", Some("k1")).unwrap();
        store.finish_future("done", &StoredOutcome::Json(r#"{"metrics":{}}"#.into())).unwrap();
        store.add_future("pending", Some("m"), "forward_backward", None).unwrap();
        assert!(store.future("pending").unwrap().is_none());
    } // the process "dies" here: nothing else is written
    let store = Store::open(&path).unwrap();
    match store.future("pending").unwrap() {
        Some(StoredOutcome::Error { message, .. }) => assert_eq!(message, RESTART_ERROR),
        other => panic!("{other:?}"),
    }
    assert!(matches!(store.future("done").unwrap(), Some(StoredOutcome::Json(j)) if j.contains("metrics")));
    assert!(store.future("unknown").is_err());
    assert_eq!(store.future_key("done").unwrap(), Some(Some("k1".to_string())));
    assert_eq!(store.future_key("unknown").unwrap(), None);
}

/// A database of schema version 2 (before futures recorded their key) opens, its futures keyed
/// by nobody (so no key reads them), new ones by their creator.
#[test]
fn a_version_2_database_is_migrated() {
    use oxrl::server::store::Store;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("server.sqlite");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE futures (id TEXT PRIMARY KEY, model_id TEXT, kind TEXT, status TEXT, json TEXT,
                 proto BLOB, error TEXT, category TEXT, created REAL, finished REAL);
             INSERT INTO futures (id, kind, status, json) VALUES ('old', 'sample', 'done', '{}');
             PRAGMA user_version = 2;",
        )
        .unwrap();
    }
    let store = Store::open(&path).unwrap();
    assert_eq!(store.future_key("old").unwrap(), Some(None));
    store.add_future("new", None, "sample", Some("k2")).unwrap();
    assert_eq!(store.future_key("new").unwrap(), Some(Some("k2".to_string())));
}

/// Requests past a limit (a rank of 10⁶ or 4.6·10¹⁸, a million-token
/// forward_backward, megabytes of metadata, 65+ samples, a result of millions of top-k values)
/// are 400s naming the limit and its flag; a path merely ending in `/healthz` needs a key; the
/// server then still trains and samples, with the loss of a fresh server.
#[test]
fn requests_past_a_limit_are_refused_by_name_and_the_server_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let refused = |r: Reply, flag: &str| {
        assert_eq!((r.status, r.body["category"].as_str()), (400, Some("user")), "{}", r.body);
        assert!(r.body["error"].as_str().unwrap().contains(flag), "{}", r.body);
    };
    assert_eq!(request(port, "GET", "/api/v1/anything/healthz", None, "").status, 401);

    let meta = json!({"blob": "x".repeat(70_000)});
    refused(post(port, "create_session", json!({"tags": [], "user_metadata": meta})), "--max-metadata-bytes");
    let session = post(port, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let model = |seq: u64, rank: u64| {
        let lora = json!({"rank": rank, "train_attn": true, "train_mlp": false, "train_unembed": false});
        post(
            port,
            "create_model",
            json!({"session_id": session, "model_seq_id": seq, "base_model": "tiny", "lora_config": lora}),
        )
    };
    refused(model(0, 1_000_000), "--max-lora-rank");
    refused(model(0, 4_600_000_000_000_000_000), "--max-lora-rank");
    let r = model(0, 4);
    assert_eq!(r.status, 200, "{}", r.body);
    let model_id = format!("{session}:train:0");
    result(port, r.body["request_id"].as_str().unwrap());

    let mut huge = fwdbwd_body(&model_id, 1, "cross_entropy");
    let n = 70_000;
    let datum = &mut huge["forward_backward_input"]["data"][0];
    datum["model_input"]["chunks"][0]["tokens"] = json!(vec![104; n]);
    datum["loss_fn_inputs"]["target_tokens"]["data"] = json!(vec![105; n]);
    datum["loss_fn_inputs"]["weights"]["data"] = json!(vec![1.0; n]);
    // A training request past a limit fails in its turn (its seq_id is used, so the model's next
    // requests do not wait for it), with the limit named in the future's error.
    let r = post(port, "forward_backward", huge);
    assert_eq!(r.status, 200, "{}", r.body);
    let failed = result(port, r.body["request_id"].as_str().unwrap());
    assert_eq!(failed["category"], "user", "{failed}");
    assert!(failed["error"].as_str().unwrap().contains("--max-train-tokens"), "{failed}");

    let s = post(
        port,
        "create_sampling_session",
        json!({"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}),
    );
    let sampler = s.body["sampling_session_id"].as_str().unwrap().to_string();
    let sample = |n: usize, max_tokens: usize, topk: usize| {
        post(
            port,
            "asample",
            json!({
                "sampling_session_id": sampler, "seq_id": 0, "num_samples": n,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]},
                "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "stop": []},
                "topk_sample_logprobs": topk
            }),
        )
    };
    refused(sample(65, 4, 0), "--max-samples");
    refused(sample(64, 254, 1024), "--max-sample-values");

    // Still serving: a sample, and a training step with the loss of a fresh server's.
    let r = sample(2, 4, 0);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(result(port, r.body["request_id"].as_str().unwrap())["sequences"].as_array().unwrap().len(), 2);
    let loss_of = |port: u16, model_id: &str, seq_id: i64| {
        let f = post(port, "forward_backward", fwdbwd_body(model_id, seq_id, "cross_entropy"));
        assert_eq!(f.status, 200, "{}", f.body);
        result(port, f.body["request_id"].as_str().unwrap())["metrics"]["loss:sum"].clone()
    };
    let after = loss_of(port, &model_id, 2);
    let fresh_dir = tempfile::tempdir().unwrap();
    let fresh = serve(fresh_dir.path(), Duration::from_millis(300));
    let fresh_session =
        post(fresh, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let lora = json!({"rank": 4, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let r = post(
        fresh,
        "create_model",
        json!({"session_id": fresh_session, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora}),
    );
    result(fresh, r.body["request_id"].as_str().unwrap());
    assert_eq!(after, loss_of(fresh, &format!("{fresh_session}:train:0"), 1));
    assert!(after.as_f64().is_some_and(f64::is_finite), "{after}");
}

/// Training models and sampling sessions alive per API key are bounded
/// (`--max-models-per-key`, `--max-samplers-per-key`); other keys are not affected.
#[test]
fn models_and_samplers_per_key_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let limits = oxrl::server::limits::Limits { max_models_per_key: 2, max_samplers_per_key: 2, ..Default::default() };
    let port = serve_limited(dir.path(), Duration::from_millis(300), 64, limits);
    let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let create = |key: &str, seq: u64| {
        let session = request(port, "POST", "/api/v1/create_session", Some(key), &json!({"tags": []}).to_string());
        let session = session.body["session_id"].as_str().unwrap().to_string();
        let body = json!({"session_id": session, "model_seq_id": seq, "base_model": "tiny", "lora_config": lora});
        request(port, "POST", "/api/v1/create_model", Some(key), &body.to_string())
    };
    assert_eq!(create("k1", 0).status, 200);
    assert_eq!(create("k1", 0).status, 200);
    let r = create("k1", 0);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body["error"].as_str().unwrap().contains("--max-models-per-key 2"), "{}", r.body);
    assert_eq!(create("k2", 0).status, 200, "another key is not limited by k1's models");
    let sampler = |key: &str, seq: u64| {
        let session = request(port, "POST", "/api/v1/create_session", Some(key), &json!({"tags": []}).to_string());
        let session = session.body["session_id"].as_str().unwrap().to_string();
        let body = json!({"session_id": session, "sampling_session_seq_id": seq, "base_model": "tiny"});
        request(port, "POST", "/api/v1/create_sampling_session", Some(key), &body.to_string())
    };
    assert_eq!(sampler("k1", 0).status, 200);
    assert_eq!(sampler("k1", 0).status, 200);
    let r = sampler("k1", 0);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body["error"].as_str().unwrap().contains("--max-samplers-per-key 2"), "{}", r.body);
    assert_eq!(sampler("k2", 0).status, 200, "another key is not limited by k1's samplers");
}

/// A run lists the `user_metadata` given to `create_model` (the cookbook takes its renderer name
/// back from it when it resumes).
#[test]
fn a_training_run_lists_its_user_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let session = post(port, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let body = json!({"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora,
                      "user_metadata": {"renderer_name": "qwen3", "step": 7}});
    let r = post(port, "create_model", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let run = request(port, "GET", &format!("/api/v1/training_runs/{session}:train:0"), Some("k1"), "");
    assert_eq!(run.status, 200, "{}", run.body);
    assert_eq!(run.body["user_metadata"], json!({"renderer_name": "qwen3", "step": 7}));
    let all = request(port, "GET", "/api/v1/training_runs", Some("k1"), "");
    assert_eq!(all.body["training_runs"][0]["user_metadata"]["renderer_name"], "qwen3");
    assert_eq!(run.body["base_model"], "tiny");
    // Created with the path given to --model: the run reports that path.
    let path = dir.path().join("tiny").display().to_string();
    let body = json!({"session_id": session, "model_seq_id": 1, "base_model": path, "lora_config": lora});
    assert_eq!(post(port, "create_model", body).status, 200);
    let run = request(port, "GET", &format!("/api/v1/training_runs/{session}:train:1"), Some("k1"), "");
    assert_eq!(run.body["base_model"], path.as_str());
    // get_info names each model's base and tokenizer as its client did: a served name, or the
    // path that client gave, never a path the server chose.
    for (seq, named) in [(0, "tiny"), (1, path.as_str())] {
        let info = post(port, "get_info", json!({"model_id": format!("{session}:train:{seq}")}));
        let data = &info.body["model_data"];
        assert_eq!((data["model_name"].as_str(), data["tokenizer_id"].as_str()), (Some(named), Some(named)));
    }
    // A run made by loading a checkpoint keeps the metadata sent with the load, and its base as
    // the checkpoint's client named it (the SDK's create_training_client_from_state).
    let r = post(port, "save_weights", json!({"model_id": format!("{session}:train:1"), "seq_id": 1, "path": "ck"}));
    let saved = result(port, r.body["request_id"].as_str().unwrap());
    let ck = saved["path"].as_str().unwrap_or_else(|| panic!("{saved}"));
    let body = json!({"session_id": session, "model_seq_id": 2, "path": ck, "optimizer": true,
                      "user_metadata": {"renderer_name": "qwen3"}});
    let r = post(port, "load_weights", body);
    assert_eq!(r.status, 200, "{}", r.body);
    let loaded = result(port, r.body["request_id"].as_str().unwrap());
    assert!(loaded.get("error").is_none(), "{loaded}");
    let run = request(port, "GET", &format!("/api/v1/training_runs/{session}:train:2"), Some("k1"), "");
    assert_eq!(
        (&run.body["user_metadata"], &run.body["base_model"]),
        (&json!({"renderer_name": "qwen3"}), &json!(path))
    );
}

/// Samplers and futures belong to the key that made them: another key's
/// `asample` on them, `GET samplers/{id}`, `retrieve_future` and `cancel_future` are 404s, as
/// for sessions and models; the owner goes on using them.
#[test]
fn samplers_and_futures_are_the_creating_keys_alone() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let as_key = |key: &str, path: &str, body: Value| {
        request(port, "POST", &format!("/api/v1/{path}"), Some(key), &body.to_string())
    };
    let session = as_key("k1", "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let s = as_key(
        "k1",
        "create_sampling_session",
        json!({"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}),
    );
    let sampler = s.body["sampling_session_id"].as_str().unwrap().to_string();
    let sample = |key: &str| {
        as_key(
            key,
            "asample",
            json!({
                "sampling_session_id": sampler, "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]},
                "sampling_params": {"max_tokens": 3, "temperature": 1.0, "stop": []}
            }),
        )
    };
    assert_eq!(sample("k2").status, 404, "k2 sampled with k1's sampler");
    assert_eq!(request(port, "GET", &format!("/api/v1/samplers/{sampler}"), Some("k2"), "").status, 404);
    assert_eq!(request(port, "GET", &format!("/api/v1/samplers/{sampler}"), Some("k1"), "").status, 200);
    let r = sample("k1");
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.body["request_id"].as_str().unwrap().to_string();
    let future = json!({"request_id": id, "allow_metadata_only": false});
    assert_eq!(as_key("k2", "retrieve_future", future.clone()).status, 404, "k2 read k1's result");
    assert_eq!(as_key("k2", "cancel_future", json!({"request_id": id})).status, 404, "k2 cancelled k1's sample");
    assert_eq!(result(port, &id)["sequences"].as_array().unwrap().len(), 1);
    // The shared sampler of a base model is anyone's.
    let base = as_key(
        "k2",
        "asample",
        json!({
            "base_model": "tiny", "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "stop": []}
        }),
    );
    assert_eq!(base.status, 200, "{}", base.body);
}

/// A sampler made from a named sampler checkpoint follows it: saved again
/// under the same name, the sampler serves the new weights (the prompt log-probs of a sampler
/// made afresh from the path); deleted, the sampler is gone (404).
#[test]
fn a_sampler_follows_its_checkpoint_when_it_is_saved_again_or_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let lora = json!({"rank": 4, "train_attn": true, "train_mlp": true, "train_unembed": true});
    let (session, model_id) = lora_model(port, lora);
    let mut steps = ModelCalls::new(port, "k1", &model_id);
    let mut step = |body: Value, path: &str| steps.call(path, body);
    let save = json!({"path": "s"});
    let path = step(save.clone(), "save_weights_for_sampler")["path"].as_str().unwrap().to_string();
    let sampler_from = |seq: u64| {
        let body = json!({"session_id": session, "sampling_session_seq_id": seq, "model_path": path});
        post(port, "create_sampling_session", body).body["sampling_session_id"].as_str().unwrap().to_string()
    };
    let prompt_logprobs = |sampler: &str| -> Reply {
        post(
            port,
            "asample",
            json!({
                "sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt_logprobs": true,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 101, 108, 108, 111]}]},
                "sampling_params": {"max_tokens": 1, "temperature": 1.0, "stop": []}
            }),
        )
    };
    let lps = |r: Reply| {
        assert_eq!(r.status, 200, "{}", r.body);
        result(port, r.body["request_id"].as_str().unwrap())["prompt_logprobs"].clone()
    };
    let old = sampler_from(0);
    let before = lps(prompt_logprobs(&old));
    // Train a step with a large learning rate, then save again under the same name.
    let mut fb = fwdbwd_body("", 0, "cross_entropy");
    let fb = fb["forward_backward_input"].take();
    step(json!({"forward_backward_input": fb}), "forward_backward");
    step(json!({"adam_params": {"learning_rate": 0.5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}}), "optim_step");
    step(save, "save_weights_for_sampler");
    let after = lps(prompt_logprobs(&old));
    assert_ne!(after, before, "the sampler still serves the overwritten checkpoint");
    assert_eq!(after, lps(prompt_logprobs(&sampler_from(1))), "not the weights saved last");
    // Deleted: the samplers made from it are gone.
    let (run, name) = (model_id.clone(), "s");
    let r = request(
        port,
        "DELETE",
        &format!("/api/v1/training_runs/{run}/checkpoints/sampler_weights/{name}"),
        Some("k1"),
        "",
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(prompt_logprobs(&old).status, 404);
}

/// Errors name checkpoints by their `tinker://` paths, never by the server's directories
///: a checkpoint whose files were removed behind the server's back.
#[test]
fn errors_name_checkpoints_not_server_paths() {
    expect_server_faults();
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let (session, model_id) = lora_model(port, lora);
    let r = post(port, "save_weights_for_sampler", json!({"model_id": model_id, "seq_id": 1, "path": "s"}));
    let path = result(port, r.body["request_id"].as_str().unwrap())["path"].as_str().unwrap().to_string();
    let files = dir.path().join("data/checkpoints").join(&model_id).join("sampler_weights/s");
    for f in std::fs::read_dir(&files).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    let r = post(
        port,
        "create_sampling_session",
        json!({"session_id": session, "sampling_session_seq_id": 0, "model_path": path}),
    );
    assert!(r.status >= 400, "{}", r.body);
    let text = r.body.to_string();
    assert!(!text.contains(&dir.path().display().to_string()), "the error shows a server path: {text}");
    assert!(text.contains(&path), "the error does not name the checkpoint: {text}");
}

/// `oxrl serve` stopped by SIGTERM finishes the work in flight before it exits (item
/// 18): a long sample submitted just before is complete, and retrievable, after a restart.
#[test]
fn sigterm_drains_the_work_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    common::tiny_byte_model(&dir.path().join("tiny"), 32, 4096, 3);
    let start = || {
        let mut child = common::oxrl_command()
            .arg("serve")
            .arg("--model")
            .arg(dir.path().join("tiny"))
            .args(["--port", "0", "--data-dir"])
            .arg(dir.path().join("data"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().unwrap()));
        let port: u16 = loop {
            let line = lines.next().expect("oxrl serve ended before listening").unwrap();
            if let Some(rest) = line.split("listening on http://127.0.0.1:").nth(1) {
                break rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        };
        (child, port, std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>()))
    };
    let (mut child, port, log) = start();
    let call =
        |port: u16, path: &str, body: Value| request(port, "POST", &format!("/api/v1/{path}"), None, &body.to_string());
    let session = call(port, "create_session", json!({"tags": []})).body["session_id"].as_str().unwrap().to_string();
    let s = call(
        port,
        "create_sampling_session",
        json!({"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}),
    );
    let sampler = s.body["sampling_session_id"].as_str().unwrap().to_string();
    let r = call(
        port,
        "asample",
        json!({
            "sampling_session_id": sampler, "seq_id": 0, "num_samples": 32,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]},
            "sampling_params": {"max_tokens": 1500, "temperature": 1.0, "stop": []}
        }),
    );
    let id = r.body["request_id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(100));
    let sent = std::time::Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    assert!(child.wait().unwrap().success());
    let log = log.join().unwrap().join("\n");
    assert!(log.contains("1 requests in flight") && log.contains("0 requests unfinished"), "{log}");
    assert!(sent.elapsed() < Duration::from_secs(30));
    let (mut child, port, _) = start();
    let r = call(port, "retrieve_future", json!({"request_id": id, "allow_metadata_only": false}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["sequences"].as_array().map(Vec::len), Some(32), "{}", r.body);
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Connections that never finish their headers hold a connection slot for
/// the idle timeout at most: with 40 of them open against a cap of 8, a health check still gets
/// its answer, and a stalled connection is closed by the server.
#[test]
fn stalled_connections_cannot_starve_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let limits = oxrl::server::limits::Limits { max_connections: 8, idle_timeout_s: 1, ..Default::default() };
    let port = serve_limited(dir.path(), Duration::from_millis(300), 64, limits);
    let stalled: Vec<TcpStream> = (0..40)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let _ = s.write_all(b"GET /api/v1/heal");
            s
        })
        .collect();
    let t = std::time::Instant::now();
    assert_eq!(request(port, "GET", "/api/v1/healthz", None, "").status, 200);
    assert!(t.elapsed() < Duration::from_secs(15), "the health check waited {:?}", t.elapsed());
    let mut first = &stalled[0];
    first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    let closed =
        matches!(first.read(&mut buf), Ok(0) | Err(_)) || String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 4");
    assert!(closed, "a stalled connection was never closed");
}

/// Finished results are kept `--result-retention-s`, then deleted (the database does not only
/// grow): retrievable at once, a 404 after the retention.
#[test]
fn results_expire_after_their_retention() {
    let dir = tempfile::tempdir().unwrap();
    let limits = oxrl::server::limits::Limits { result_retention_s: 1, ..Default::default() };
    let port = serve_limited(dir.path(), Duration::from_millis(300), 64, limits);
    let r = post(
        port,
        "asample",
        json!({
            "base_model": "tiny", "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 1.0, "stop": []}
        }),
    );
    let id = r.body["request_id"].as_str().unwrap().to_string();
    assert_eq!(result(port, &id)["sequences"].as_array().unwrap().len(), 1);
    let t = std::time::Instant::now();
    loop {
        let r = post(port, "retrieve_future", json!({"request_id": id, "allow_metadata_only": false}));
        if r.status == 404 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the result was never deleted: {}", r.body);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t.elapsed() >= Duration::from_millis(500), "deleted before its retention");
}

/// A model's tokens in flight (accepted, not yet done) are bounded by a memory budget
/// (`--max-tokens-in-flight`; by default derived from the machine and the model): past it a
/// request fails in its turn naming the limit, and tokens are given back when requests finish.
#[test]
fn tokens_in_flight_are_admitted_within_a_budget() {
    let dir = tempfile::tempdir().unwrap();
    let limits = oxrl::server::limits::Limits { max_tokens_in_flight: 25, ..Default::default() };
    let port = serve_limited(dir.path(), Duration::from_millis(300), 64, limits);
    let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let (_, model_id) = lora_model(port, lora);
    // 10 tokens each. Seqs 2 and 3 wait for seq 1 and hold 20 tokens; seq 4 would make 30.
    let submit = |seq: i64| {
        let r = post(port, "forward_backward", fwdbwd_body(&model_id, seq, "cross_entropy"));
        assert_eq!(r.status, 200, "{}", r.body);
        r.body["request_id"].as_str().unwrap().to_string()
    };
    let ids: Vec<String> = [2, 3, 4, 1].into_iter().map(submit).collect();
    let outcome: Vec<Value> = ids.iter().map(|id| result(port, id)).collect();
    for (seq, o) in [2, 3].iter().zip(&outcome) {
        assert!(o["metrics"]["loss:sum"].as_f64().is_some(), "seq {seq}: {o}");
    }
    for (seq, o) in [4, 1].iter().zip(&outcome[2..]) {
        assert_eq!(o["category"], "user", "seq {seq}: {o}");
        assert!(o["error"].as_str().unwrap().contains("--max-tokens-in-flight"), "seq {seq}: {o}");
    }
    // Everything finished: the tokens are back.
    assert!(result(port, &submit(5))["metrics"]["loss:sum"].as_f64().is_some());
    // The derived budget: half the available memory over the model's bytes per token, at least
    // the per-request limit.
    let l = oxrl::server::limits::Limits::default();
    assert_eq!(l.tokens_in_flight_budget(1000, Some(1 << 30)), (1 << 29) / 1000);
    assert_eq!(l.tokens_in_flight_budget(1 << 20, Some(1 << 30)), l.max_train_tokens);
    assert_eq!(l.tokens_in_flight_budget(1000, None), usize::MAX);
}

/// A GET without an API key, as urllib sends it: (status, Content-Length header, body bytes).
fn download(port: u16, url: &str) -> (u16, Option<usize>, Vec<u8>) {
    let path = url.split_once("://").map(|(_, rest)| &rest[rest.find('/').unwrap()..]).unwrap_or(url);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = vec![];
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status = head[9..12].parse().unwrap();
    let length = head.lines().find_map(|l| l.strip_prefix("content-length:")).map(|v| v.trim().parse().unwrap());
    let body = raw[split + 4..].to_vec();
    // The sweep of honest error categories (see `request`) over the refused downloads too.
    if status >= 400 && !SERVER_FAULTS_EXPECTED.get() {
        let answer: Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_ne!(answer["category"], "server", "GET {path}: a refusal reported as the server's fault: {answer}");
    }
    (status, length, body)
}

/// The tensors of a safetensors file as (name, f32 values).
fn tensors(bytes: &[u8]) -> Vec<(String, Vec<f32>)> {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = match view.dtype() {
                safetensors::Dtype::F32 => {
                    view.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                }
                safetensors::Dtype::BF16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
                    .collect(),
                other => panic!("{name}: dtype {other:?}"),
            };
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// `save_weights_external` at the HTTP level: an unencrypted export's
/// signed URLs download, without an API key, the adapter the model has (the save_state
/// checkpoint's tensors, the sampler export's bytes); a tampered or expired URL is a 403, a
/// deleted checkpoint's a 404, another key's checkpoint a 404; bad recipient lists are 400s.
#[test]
fn external_weights_download_through_signed_urls() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let lora = json!({"rank": 4, "train_attn": true, "train_mlp": true, "train_unembed": false});
    let (_session, model_id) = lora_model(port, lora);
    let mut steps = ModelCalls::new(port, "k1", &model_id);
    let mut step = |body: Value, path: &str| steps.call(path, body);
    // Train a step so that lora_B is not zero, then save it three ways.
    let mut fb = fwdbwd_body("", 0, "cross_entropy");
    step(json!({"forward_backward_input": fb["forward_backward_input"].take()}), "forward_backward");
    step(json!({"adam_params": {"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}}), "optim_step");
    step(json!({"path": "state"}), "save_weights");
    step(json!({"path": "sampler"}), "save_weights_for_sampler");
    let saved =
        step(json!({"path": "final", "ttl_seconds": 3600, "type": "save_weights_external"}), "save_weights_external");
    let uri = format!("tinker://{model_id}/external_weights/final");
    assert_eq!(saved["path"], uri.as_str(), "{saved}");
    assert_eq!(saved["type"], "save_weights_external");

    let base = format!("/api/v1/training_runs/{model_id}/checkpoints/external_weights/final");
    let signed = request(port, "GET", &format!("{base}/external_weights_urls"), Some("k1"), "");
    assert_eq!(signed.status, 200, "{}", signed.body);
    let expires = signed.body["expires"].as_str().unwrap();
    assert!(expires.ends_with('Z') && expires.len() == 20, "{expires}");
    let urls = signed.body["urls"].as_object().unwrap();
    let names: Vec<&str> = urls.keys().map(String::as_str).collect();
    assert_eq!(names, ["adapter_config.json", "adapter_model.safetensors"]);
    let url = |f: &str| urls[f].as_str().unwrap().to_string();
    assert!(
        url("adapter_model.safetensors").starts_with("http://x/api/v1/external_weights_files/"),
        "{}",
        url("adapter_model.safetensors")
    );

    let ckpt = dir.path().join("data/checkpoints").join(&model_id);
    let mut size = 0;
    for f in names.iter().copied() {
        let (status, length, bytes) = download(port, &url(f));
        assert_eq!(status, 200, "{f}: {}", String::from_utf8_lossy(&bytes));
        assert_eq!(length, Some(bytes.len()), "{f}: Content-Length");
        assert_eq!(bytes, std::fs::read(ckpt.join("sampler_weights/sampler").join(f)).unwrap(), "{f}: not the export");
        size += bytes.len();
    }
    assert_eq!(saved["size_bytes"], size, "{saved}");
    // An independent read: the adapter tensors of the save_state checkpoint.
    let got = tensors(&download(port, &url("adapter_model.safetensors")).2);
    let want = tensors(&std::fs::read(ckpt.join("weights/state/adapter_model.safetensors")).unwrap());
    assert_eq!(got, want);
    assert!(got.iter().any(|(n, v)| n.contains("lora_B") && v.iter().any(|x| *x != 0.0)), "untrained adapter");
    let config: Value = serde_json::from_slice(&download(port, &url("adapter_config.json")).2).unwrap();
    assert_eq!(config["r"], 4, "{config}");

    // Listed with the run's checkpoints; TTL settable; another key sees nothing.
    let listed = request(port, "GET", &format!("/api/v1/training_runs/{model_id}/checkpoints"), Some("k1"), "");
    let external: Vec<&Value> =
        listed.body["checkpoints"].as_array().unwrap().iter().filter(|c| c["checkpoint_type"] == "external").collect();
    assert_eq!(external.len(), 1, "{}", listed.body);
    assert_eq!(external[0]["tinker_path"], uri.as_str());
    assert!(external[0]["expires_at"].is_number(), "{}", listed.body);
    let ttl = |key: &str| request(port, "PUT", &format!("{base}/ttl"), Some(key), r#"{"ttl_seconds": 7200}"#).status;
    assert_eq!(ttl("k1"), 200);
    assert_eq!(ttl("k2"), 404);
    assert_eq!(request(port, "GET", &format!("{base}/external_weights_urls"), Some("k2"), "").status, 404);
    assert_eq!(request(port, "GET", &format!("{base}/external_weights_urls"), None, "").status, 401);
    assert_eq!(request(port, "DELETE", &base, Some("k2"), "").status, 404);
    let other_kind = format!("/api/v1/training_runs/{model_id}/checkpoints/weights/state/external_weights_urls");
    assert_eq!(request(port, "GET", &other_kind, Some("k1"), "").status, 400);

    // Tampered, re-dated and expired URLs: 403 (the last signed with the server's own secret).
    let good = url("adapter_model.safetensors");
    let (head, sig) = good.rsplit_once("&sig=").unwrap();
    let flipped = format!("{head}&sig={}{}", if sig.starts_with('0') { "1" } else { "0" }, &sig[1..]);
    assert_eq!(download(port, &flipped).0, 403);
    assert_eq!(download(port, &good.replacen("expires=", "expires=1", 1)).0, 403);
    assert_eq!(download(port, head).0, 403);
    let other_file = good.replace("adapter_model.safetensors", "adapter_config.json");
    assert_eq!(download(port, &other_file).0, 403, "a signature is for one file");
    // Only the file route goes without an API key, and only in its exact shape.
    let files = "/api/v1/external_weights_files";
    for path in [format!("{files}/a/b"), format!("{files}/a/b/c/d"), format!("{files}x/a/b/c")] {
        assert_eq!(request(port, "GET", &path, None, "").status, 401, "{path}");
    }
    let signer = oxrl::server::external_weights::UrlSigner::open(&dir.path().join("data")).unwrap();
    let past = oxrl::server::store::now() as u64 - 10;
    let expired = signer.url("http://x", &model_id, "final", "adapter_model.safetensors", past);
    let (status, _, body) = download(port, &expired);
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("expired"));

    // Deleted: the still-valid URLs are 404s.
    assert_eq!(request(port, "DELETE", &base, Some("k1"), "").status, 200);
    let (status, _, body) = download(port, &good);
    assert_eq!(status, 404);
    assert!(!String::from_utf8_lossy(&body).contains(&dir.path().display().to_string()), "a server path");
    assert_eq!(request(port, "GET", &format!("{base}/external_weights_urls"), Some("k1"), "").status, 404);

    // Recipient lists: empty, too many, not age keys → 400 naming the problem.
    let key = "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"; // the age spec's example
    let bad: [(Value, &str); 3] = [
        (json!([]), "empty"),
        (json!(vec![key; 11]), "at most 10"),
        (json!([key, "ssh-ed25519 AAAAC3Nza"]), "not an age x25519 public key"),
    ];
    // Refused in their turn (each takes its seq_id: the next requests do not wait for them).
    for (recipients, why) in bad {
        let failed = step(json!({"path": "enc", "age_encryption_recipients": recipients}), "save_weights_external");
        assert_eq!(failed["category"], "user", "{why}: {failed}");
        assert!(failed["error"].as_str().unwrap().contains(why), "{why}: {failed}");
    }
    let saved = step(json!({"path": "after"}), "save_weights");
    assert_eq!(saved["path"], format!("tinker://{model_id}/weights/after"), "{saved}");
}

/// Ephemeral samplers are capped per API key: one key's RL loop (a sampler per iteration)
/// evicts its own oldest, never another key's.
#[test]
fn ephemeral_samplers_are_capped_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let port = serve(dir.path(), Duration::from_millis(300));
    let lora = json!({"rank": 2, "train_attn": true, "train_mlp": false, "train_unembed": false});
    let as_key = |key: &str, path: &str, body: Value| {
        let r = post_as(port, key, path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        r.body
    };
    let done = |key: &str, r: Value| result_as(port, key, r["request_id"].as_str().unwrap());
    let model_of = |key: &str| {
        let session = as_key(key, "create_session", json!({"tags": []}))["session_id"].as_str().unwrap().to_string();
        let body = json!({"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora});
        done(key, as_key(key, "create_model", body));
        format!("{session}:train:0")
    };
    let ephemeral = |key: &str, model: &str, n: i64| {
        let body = json!({"model_id": model, "seq_id": n + 1, "sampling_session_seq_id": n});
        let out = done(key, as_key(key, "save_weights_for_sampler", body));
        out["sampling_session_id"].as_str().unwrap_or_else(|| panic!("{out}")).to_string()
    };
    let (a, b) = (model_of("k1"), model_of("k2"));
    let kept = ephemeral("k2", &b, 0);
    let first = ephemeral("k1", &a, 0);
    for n in 1..=oxrl::server::samplers::MAX_EPHEMERAL as i64 {
        ephemeral("k1", &a, n);
    }
    let sampler = |key: &str, id: &str| request(port, "GET", &format!("/api/v1/samplers/{id}"), Some(key), "").status;
    assert_eq!(sampler("k1", &first), 404, "k1's oldest was not evicted");
    assert_eq!(sampler("k2", &kept), 200, "k1's loop evicted k2's sampler");
}
