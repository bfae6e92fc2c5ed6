//! `oxrl engine`'s OpenAI endpoints answer the official `openai` Python client (installed by
//! `.ci/run` in the venv of the tinker SDK): the model list, greedy completions and chat
//! completions equal to `oxrl generate` (text and token ids), log-probs, and a refused request
//! without the API key.

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use crate::remote_engine::EngineProcess;

const OPENAI: &str = "openai==3.57.0";

/// The venv's python with the `openai` client, or None when there is no Python at all.
pub fn openai_python() -> Option<PathBuf> {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv-tinker/bin/python");
    let has_client = |p: &PathBuf| Command::new(p).args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    if python.exists() && has_client(&python) {
        return Some(python);
    }
    ["python3", "python"].into_iter().find(|p| Command::new(p).arg("--version").output().is_ok())?;
    panic!("{OPENAI} is not installed in .venv-tinker: run `.ci/run` once, or `.venv-tinker/bin/python -m pip install {OPENAI}`");
}

const SCRIPT: &str = r#"
import json, sys, openai
url, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=url + "/v1", api_key=key)
out = {"models": [m.id for m in client.models.list().data]}
c = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0, logprobs=2)
out["completion"] = {"text": c.choices[0].text, "token_ids": c.choices[0].model_extra["token_ids"],
                     "logprobs": c.choices[0].logprobs.token_logprobs, "finish": c.choices[0].finish_reason}
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                   temperature=0, logprobs=True, top_logprobs=2)
ch = r.choices[0]
out["chat"] = {"text": ch.message.content, "token_ids": ch.model_extra["token_ids"],
               "logprobs": [t.logprob for t in ch.logprobs.content], "top": len(ch.logprobs.content[0].top_logprobs)}
try:
    openai.OpenAI(base_url=url + "/v1", api_key="wrong").models.list()
    out["wrong_key"] = "accepted"
except openai.AuthenticationError:
    out["wrong_key"] = "refused"
print(json.dumps(out))
"#;

/// `oxrl generate` greedy, 8 tokens: (text, token ids, log-probs).
fn generate(model: &std::path::Path, chat: bool) -> (String, Vec<u64>, Vec<f64>) {
    let mut c = common::oxrl_command();
    c.arg("generate").arg("--model").arg(model).args(["--prompt", "Hello", "--max-tokens", "8", "--temperature", "0"]);
    if chat {
        c.arg("--chat");
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let lps = v["logprobs"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
    (v["text"].as_str().unwrap().to_string(), ids, lps)
}

#[test]
fn the_openai_client_samples_what_oxrl_generate_does() {
    let Some(python) = openai_python() else {
        eprintln!("SKIPPED: no python3 on this machine");
        return;
    };
    let model = common::fixture_dir("qwen3");
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# engine keys\nsecret-1\n").unwrap();
    let engine = EngineProcess::start(&model, &["--api-keys", keys.to_str().unwrap()]);
    let out = Command::new(python).args(["-c", SCRIPT, &engine.url, "secret-1", "qwen3"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["models"], serde_json::json!(["qwen3"]));
    assert_eq!(got["wrong_key"], "refused");
    for (key, chat) in [("completion", false), ("chat", true)] {
        let (text, ids, lps) = generate(&model, chat);
        let g = &got[key];
        assert_eq!(g["text"], text.as_str(), "{key}: text");
        assert_eq!(g["token_ids"], serde_json::json!(ids), "{key}: token ids");
        let served: Vec<f64> = g["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(served.len(), lps.len(), "{key}");
        for (a, b) in served.iter().zip(&lps) {
            assert!((a - b).abs() < 1e-6, "{key}: log-prob {a} vs oxrl generate's {b}");
        }
    }
    assert_eq!(got["chat"]["top"], 2);
}
