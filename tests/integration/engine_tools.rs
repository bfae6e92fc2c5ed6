//! Tool calls in `oxrl engine`'s chat completions: a conversation with tools — a system turn,
//! an assistant turn with a tool call, consecutive `tool` results — renders exactly as
//! transformers' `apply_chat_template(tools=…)` renders it (tests/fixtures/chat_tools, made by
//! its make_fixture.py), both through the tokenizer and as the prompt the engine runs when an
//! OpenAI client sends the conversation in its own form (arguments as JSON text, content null);
//! a reply without a parsable call is content, `tool_choice` `none` renders no tools, and
//! `required` is refused with a 400 naming `tool_choice`. And a model that replies with a Hermes
//! tool call (a scripted one: its greedy reply is a fixed run of added tokens) gets it back as
//! `tool_calls` with parsed arguments, streamed or not; a malformed call comes back as content.
//! (Reading calls out of replies in general: `engine_server::tool_calls`'s unit tests.)

use crate::common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use oxrl::model::model_config::{Arch, ModelShape};
use oxrl::model::tokenizer::{Tokenizer, BYTE_LEVEL_VOCAB_SIZE};
use serde_json::{json, Value};

use crate::remote_engine::EngineProcess;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tools/rendered.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The qwen3 fixture with the tool-calling template and a longer context, in `dir`.
fn model_with_tool_template(dir: &Path) -> std::path::PathBuf {
    let model = dir.join("qwen3-tools");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(common::fixture_dir("qwen3")).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
        }
    }
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tools/chat_template.jinja");
    std::fs::copy(template, model.join("chat_template.jinja")).unwrap();
    // Room for the tool schemas (the fixture's 256 positions are too few).
    let config = model.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["max_position_embeddings"] = json!(2048);
    std::fs::write(&config, c.to_string()).unwrap();
    model
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent
        .post(format!("{url}/v1/chat/completions"))
        .content_type("application/json")
        .send(body.to_string())
        .unwrap();
    let status = r.status().as_u16();
    (status, serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap())
}

#[test]
fn conversations_with_tools_render_as_transformers_renders_them() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_with_tool_template(dir.path());
    let tok = Tokenizer::from_dir(&model).unwrap();
    let cases = fixture()["cases"].as_array().unwrap().clone();
    assert_eq!(cases.len(), 4);
    for (i, case) in cases.iter().enumerate() {
        let messages = case["messages"].as_array().unwrap();
        let tools = Some(&case["tools"]).filter(|t| !t.is_null());
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let text = tok.apply_chat_template(messages, add, tools).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "case {i}");
        assert_eq!(json!(tok.encode_chat(messages, add, tools).unwrap()), case["ids"], "case {i}");
    }

    // The engine, sent the third conversation as an OpenAI client sends it.
    let engine = EngineProcess::start(&model, &[]);
    let mut messages = cases[2]["messages"].clone();
    let call = &mut messages[1]["tool_calls"][0]["function"];
    call["arguments"] = json!(call["arguments"].to_string());
    let tools = cases[2]["tools"].clone();
    let body = json!({"model": "qwen3-tools", "messages": messages, "tools": tools, "max_tokens": 8, "temperature": 0});
    let (status, r) = post(&engine.url, &body);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["prompt_token_ids"], cases[2]["ids"]);
    // The tiny random model writes no tool call: its reply is content.
    let choice = &r["choices"][0];
    assert!(choice["message"]["content"].is_string() && choice["message"].get("tool_calls").is_none(), "{choice}");
    assert_eq!(choice["finish_reason"], "length");

    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    none["messages"] = cases[0]["messages"].clone();
    let (status, r) = post(&engine.url, &none);
    assert_eq!(status, 200, "{r}");
    let plain = tok.encode_chat(cases[0]["messages"].as_array().unwrap(), true, None).unwrap();
    assert_eq!(r["prompt_token_ids"], json!(plain));

    let mut required = body.clone();
    required["tool_choice"] = json!("required");
    let (status, r) = post(&engine.url, &required);
    assert_eq!((status, r["error"]["param"].as_str()), (400, Some("tool_choice")), "{r}");
}

/// The tokens the scripted models write (non-special added tokens; no spaces, which byte-level
/// decoding would not keep).
const ADDED: [&str; 4] = [
    "<tool_call>",
    r#"{"name":"get_weather","arguments":{"city":"Paris","days":2}}"#,
    r#"{"name":"get_weather","arguments":{"city":"#,
    "</tool_call>",
];

/// A model whose greedy reply to any chat is `script` (indices into [`ADDED`]) then
/// `<|im_end|>`: its blocks add nothing (o_proj and down_proj zero), so the next token depends
/// on the last one alone, and the embeddings and LM head chain "\n" (the end of the generation
/// prompt) → script[0] → script[1] → … → end.
fn scripted_model(dir: &Path, script: &[usize]) -> std::path::PathBuf {
    let hidden = 64;
    let vocab = BYTE_LEVEL_VOCAB_SIZE + ADDED.len();
    let shape = ModelShape {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: 2 * hidden,
        num_layers: 1,
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 16,
        rope_theta: 10000.0,
        max_position_embeddings: 2048,
        tie_word_embeddings: false,
    };
    oxrl::model::init::write_random_model(dir, Arch::Qwen3, &shape, 1, DType::F32).unwrap();
    let tok_path = dir.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    for (k, content) in ADDED.iter().enumerate() {
        tok["added_tokens"].as_array_mut().unwrap().push(json!({"id": BYTE_LEVEL_VOCAB_SIZE + k, "content": content,
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}));
    }
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    let newline = Tokenizer::from_dir(dir).unwrap().encode("\n", false).unwrap()[0] as usize;
    let chain: Vec<usize> =
        std::iter::once(newline).chain(script.iter().map(|&k| BYTE_LEVEL_VOCAB_SIZE + k)).chain([2]).collect();
    let (mut embed, mut head) = (vec![0f32; vocab * hidden], vec![0f32; vocab * hidden]);
    for (state, pair) in chain.windows(2).enumerate() {
        embed[pair[0] * hidden + state] = 1.0;
        head[pair[1] * hidden + state] = 10.0;
    }
    let weights = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            *t = t.zeros_like().unwrap();
        }
    }
    tensors.insert("model.embed_tokens.weight".into(), Tensor::from_vec(embed, (vocab, hidden), &Device::Cpu).unwrap());
    tensors.insert("lm_head.weight".into(), Tensor::from_vec(head, (vocab, hidden), &Device::Cpu).unwrap());
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    dir.to_path_buf()
}

/// The data chunks of a server-sent event stream.
fn sse_chunks(url: &str, body: &Value) -> Vec<Value> {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent
        .post(format!("{url}/v1/chat/completions"))
        .content_type("application/json")
        .send(body.to_string())
        .unwrap();
    let text = r.body_mut().read_to_string().unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[test]
fn a_hermes_tool_call_in_the_reply_comes_back_as_tool_calls_and_a_malformed_one_as_content() {
    let dir = tempfile::tempdir().unwrap();
    let tools = fixture()["cases"][0]["tools"].clone();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                      "max_tokens": 10, "temperature": 0});

    let good = EngineProcess::start(&scripted_model(&dir.path().join("m"), &[0, 1, 3]), &[]);
    let (status, r) = post(&good.url, &body);
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    assert!(choice["message"]["content"].is_null(), "{choice}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0]["type"].as_str(), calls[0]["function"]["name"].as_str()),
        (Some("function"), Some("get_weather"))
    );
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 2}));
    let b = BYTE_LEVEL_VOCAB_SIZE as u64;
    assert_eq!(choice["token_ids"], json!([b, b + 1, b + 3, 2]));
    // Streamed: the whole choice in its last chunk.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_chunks(&good.url, &streamed);
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");
    assert_eq!(last["delta"]["tool_calls"][0]["function"], calls[0]["function"]);
    assert_eq!(last["delta"]["tool_calls"][0]["index"], 0);
    // Without tools the same reply is plain content.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("tools");
    let (_, r) = post(&good.url, &plain);
    assert_eq!(r["choices"][0]["message"]["content"], format!("{}{}{}", ADDED[0], ADDED[1], ADDED[3]));
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    let bad = EngineProcess::start(&scripted_model(&dir.path().join("bad"), &[0, 2, 3]), &[]);
    let (status, r) = post(
        &bad.url,
        &json!({"model": "bad", "messages": body["messages"], "tools": tools, "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["message"]["content"], format!("{}{}{}", ADDED[0], ADDED[2], ADDED[3]));
    assert!(choice["message"].get("tool_calls").is_none(), "{choice}");
    assert_eq!(choice["finish_reason"], "stop");
}
