//! `oxrl engine`'s `/v1/completions` in the shapes lm-evaluation-harness's `local-completions`
//! sends, through the official `openai` client: a batch of token-id prompts with `echo`,
//! `logprobs: 1` and `max_tokens` 0 or 1 (the prompt log-probs are `oxrl score`'s, value for
//! value as JSON carries them; `null` first; a top entry of a token holds its log-prob's bits),
//! string prompts with `n` (choice `index` = prompt × n + sample, seeded samples), stop strings,
//! exact usage, `logit_bias`, `/v1/models` with a LoRA adapter and requests that name it, and
//! unsupported or malformed fields refused with a 400 naming them.

use crate::common;

use std::process::Command;

use serde_json::{json, Value};

use crate::engine_openai::openai_python;
use crate::remote_engine::EngineProcess;

const SCRIPT: &str = r#"
import json, sys, openai
url, model, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = openai.OpenAI(base_url=url + "/v1", api_key="none")
out = {}
def dump(c):
    return [{"index": ch.index, "text": ch.text, "finish": ch.finish_reason, "token_ids": ch.model_extra["token_ids"],
             "logprobs": None if ch.logprobs is None else ch.logprobs.model_dump()} for ch in c.choices]
for max_tokens in [0, 1]:
    c = client.completions.create(model=model, prompt=prompts, max_tokens=max_tokens, temperature=0, logprobs=1,
                                  echo=True, seed=1234)
    out[f"echo_{max_tokens}"] = {"choices": dump(c), "usage": c.usage.model_dump()}
c = client.completions.create(model=model, prompt=["Hello", "Hi there"], n=2, max_tokens=6, temperature=1.0, seed=7)
out["strings"] = {"choices": dump(c), "usage": c.usage.model_dump()}
c = client.completions.create(model=model, prompt="Hello", n=2, max_tokens=6, temperature=1.0, seed=8)
out["seed8"] = dump(c)
c = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.0, seed=8)
out["seed8_alone"] = dump(c)
c = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.0, seed=9)
out["seed9_alone"] = dump(c)
full = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0).choices[0].text
stop = full[4:6]
c = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
out["stop"] = {"full": full, "stop": stop, "text": c.choices[0].text, "finish": c.choices[0].finish_reason}
out["models"] = [m.id for m in client.models.list().data]
c = client.completions.create(model="tuned", prompt=prompts[:1], max_tokens=0, echo=True, logprobs=0)
out["adapter"] = dump(c)
refused = {}
c = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=1.0, seed=3, logit_bias={"77": 100},
                              logprobs=1)
out["biased"] = dump(c)
for field, value in [("suffix", "x"), ("logit_bias", {"99999": 10}), ("best_of", 3), ("presence_penalty", 0.5)]:
    try:
        client.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body={field: value})
        refused[field] = "accepted"
    except openai.BadRequestError as e:
        refused[field] = [e.status_code, e.body["param"]]
out["refused"] = refused
print(json.dumps(out))
"#;

/// `oxrl score` of `seqs` (with `--lora`): each sequence's log-probs, null first.
fn score(model: &std::path::Path, lora: Option<&std::path::Path>, seqs: &[Vec<u32>]) -> Vec<Vec<Value>> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, seqs.iter().map(|s| json!({"tokens": s}).to_string() + "\n").collect::<String>()).unwrap();
    let mut c = common::oxrl_command();
    c.arg("score").arg("--model").arg(model).arg("--input").arg(&input).args(["--batch-size", "2"]);
    if let Some(l) = lora {
        c.arg("--lora").arg(l);
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["logprobs"].as_array().unwrap().clone())
        .collect()
}

#[test]
fn lm_eval_request_shapes_get_the_prompt_logprobs_of_oxrl_score() {
    let Some(python) = openai_python() else {
        eprintln!("SKIPPED: no python3 on this machine");
        return;
    };
    let model = common::fixture_dir("qwen3");
    let lora = model.join("lora");
    let prompts: Vec<Vec<u32>> =
        vec![vec![5, 17, 99, 3, 42, 250, 8], vec![11, 12], vec![200; 1], vec![7, 8, 9, 10, 11]];
    let lora_arg = format!("tuned={}", lora.display());
    let engine = EngineProcess::start(&model, &["--lora", &lora_arg]);
    let arg = serde_json::to_string(&prompts).unwrap();
    let out = Command::new(python).args(["-c", SCRIPT, &engine.url, "qwen3", &arg]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();

    let scored = score(&model, None, &prompts);
    for max_tokens in [0usize, 1] {
        let r = &got[format!("echo_{max_tokens}")];
        let choices = r["choices"].as_array().unwrap();
        assert_eq!(choices.len(), prompts.len());
        for (i, (ch, p)) in choices.iter().zip(&prompts).enumerate() {
            assert_eq!(ch["index"], i);
            let lp = &ch["logprobs"];
            let lps = lp["token_logprobs"].as_array().unwrap();
            assert_eq!(lps.len(), p.len() + max_tokens, "prompt {i}: every prompt token, then the sampled");
            // The prompt's log-probs are oxrl score's, as the same JSON numbers.
            assert_eq!(&lps[..p.len()], &scored[i][..], "prompt {i}, max_tokens {max_tokens}");
            let tops = lp["top_logprobs"].as_array().unwrap();
            assert!(tops[0].is_null());
            for (k, top) in tops.iter().enumerate().skip(1) {
                let top = top.as_object().unwrap();
                assert_eq!(top.len(), 1);
                // lm-eval's greedy check: the token's log-prob equals the top one iff it is the top.
                let best = top.values().next().unwrap();
                assert!(best.as_f64() >= lps[k].as_f64(), "prompt {i} position {k}");
                // (Byte pieces of a character all print as U+FFFD: those say nothing.)
                let piece = lp["tokens"][k].as_str().unwrap();
                if top.keys().next().unwrap() == piece && !piece.contains('\u{FFFD}') {
                    assert_eq!(best, &lps[k], "prompt {i} position {k}: the top entry of the token");
                }
            }
            assert_eq!(ch["token_ids"].as_array().unwrap().len(), max_tokens);
            assert_eq!(ch["finish"], "length");
        }
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        let u = &r["usage"];
        assert_eq!(
            (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()),
            (Some(prompt_tokens as u64), Some(4 * max_tokens as u64))
        );
    }
    // The adapter by name: oxrl score with that adapter.
    let with_lora = score(&model, Some(&lora), &prompts[..1]);
    assert_eq!(got["adapter"][0]["logprobs"]["token_logprobs"], Value::Array(with_lora[0].clone()));
    assert_ne!(with_lora[0], scored[0]);
    assert_eq!(got["models"], json!(["qwen3", "tuned"]));

    // Two string prompts × n = 2: indices in prompt-major order, echo off, exact usage.
    let s = &got["strings"];
    let choices = s["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    let completion: usize = choices.iter().map(|c| c["token_ids"].as_array().unwrap().len()).sum();
    assert_eq!(s["usage"]["completion_tokens"], completion);
    assert_eq!(completion, 4 * 6);
    // Seeded: sample j draws from seed + j, so sample 0 is the request alone with that seed and
    // sample 1 the request alone with seed + 1.
    assert_eq!(got["seed8"][0]["token_ids"], got["seed8_alone"][0]["token_ids"]);
    assert_eq!(got["seed8"][1]["token_ids"], got["seed9_alone"][0]["token_ids"]);
    // A stop string ends the text before its first occurrence.
    let st = &got["stop"];
    let (full, stop) = (st["full"].as_str().unwrap(), st["stop"].as_str().unwrap());
    assert_eq!(stop.chars().count(), 2, "the greedy text {full:?} is long enough to cut");
    assert_eq!(
        (st["text"].as_str().unwrap(), st["finish"].as_str().unwrap()),
        (&full[..full.find(stop).unwrap()], "stop")
    );
    // A bias of +100 on one token: every draw is that token, all but certain under the biased
    // distribution.
    let biased = &got["biased"][0];
    assert_eq!(biased["token_ids"], json!([77, 77, 77, 77, 77]));
    assert!(biased["logprobs"]["token_logprobs"].as_array().unwrap().iter().all(|l| l.as_f64().unwrap() > -1e-3));
    for field in ["suffix", "logit_bias", "best_of", "presence_penalty"] {
        assert_eq!(got["refused"][field], json!([400, field]), "{field}");
    }
}
