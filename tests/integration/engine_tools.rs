//! Tool calls in `oxrl engine`'s chat completions: a conversation with tools — a system turn,
//! an assistant turn with a tool call, consecutive `tool` results — renders exactly as
//! transformers' `apply_chat_template(tools=…)` renders it (tests/fixtures/chat_tools, made by
//! its make_fixture.py), both through the tokenizer and as the prompt the engine runs when an
//! OpenAI client sends the conversation in its own form (arguments as JSON text, content null);
//! a reply without a parsable call is content, `tool_choice` `none` renders no tools, and
//! `required` is refused with a 400 naming `tool_choice`. (Reading calls out of replies:
//! `engine_server::tool_calls`'s unit tests.)

use crate::common;

use std::path::Path;

use oxrl::model::tokenizer::Tokenizer;
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
