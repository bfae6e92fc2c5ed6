//! `stream: true` on `oxrl engine`, through the official `openai` client: concatenated per
//! choice, a streamed answer is exactly the unstreamed one — completions (two prompts × n = 2,
//! seeded sampling, log-probs with top-2, a stop string, and with `echo`) and chat completions
//! (n = 2, log-probs) — text, token ids, log-probs, finish reasons and the usage of
//! `include_usage`; and a client that disconnects mid-stream frees its rows in the engine at
//! once (its `/health` load drops to zero long before the request could have finished).

use crate::common;

use std::process::Command;

use serde_json::Value;

use crate::engine_openai::openai_python;
use crate::remote_engine::EngineProcess;

const SCRIPT: &str = r#"
import json, sys, time, urllib.request, openai
url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=url + "/v1", api_key="none")
out = {}

def completion_choice(acc, ch):
    a = acc.setdefault(ch.index, {"text": "", "token_ids": [], "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                  "text_offset": [], "finish": None})
    a["text"] += ch.text
    a["token_ids"] += ch.model_extra.get("token_ids", [])
    if ch.logprobs is not None:
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"]:
            a[key] += getattr(ch.logprobs, key)
    if ch.finish_reason:
        a["finish"] = ch.finish_reason

def completions(kw):
    whole, streamed = {}, {}
    c = client.completions.create(**kw)
    for ch in c.choices:
        completion_choice(whole, ch)
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for ch in chunk.choices:
            completion_choice(streamed, ch)
    return {"whole": whole, "streamed": streamed, "usage": c.usage.model_dump(), "streamed_usage": usage}

out["completions"] = completions(dict(model=model, prompt=["Hello", "Hi there"], n=2, max_tokens=24, temperature=1.0,
                                      seed=11, logprobs=2, stop=["ab", "\n\n"]))
out["echo"] = completions(dict(model=model, prompt=[[5, 17, 99, 3], [40, 41]], max_tokens=3, temperature=0, logprobs=1,
                               echo=True))

def chat_choice(acc, ch, message):
    a = acc.setdefault(ch.index, {"content": "", "token_ids": [], "logprobs": [], "finish": None})
    a["content"] += message.content or ""
    a["token_ids"] += ch.model_extra.get("token_ids", [])
    if ch.logprobs is not None and ch.logprobs.content is not None:
        a["logprobs"] += [[t.token, t.logprob, [[x.token, x.logprob] for x in t.top_logprobs]] for t in ch.logprobs.content]
    if ch.finish_reason:
        a["finish"] = ch.finish_reason

kw = dict(model=model, messages=[{"role": "user", "content": "Hello"}], n=2, max_tokens=20, temperature=1.0, seed=5,
          logprobs=True, top_logprobs=2)
whole, streamed, usage = {}, {}, None
r = client.chat.completions.create(**kw)
for ch in r.choices:
    chat_choice(whole, ch, ch.message)
for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for ch in chunk.choices:
        chat_choice(streamed, ch, ch.delta)
out["chat"] = {"whole": whole, "streamed": streamed, "usage": r.usage.model_dump(), "streamed_usage": usage}

def health():
    with urllib.request.urlopen(url + "/health") as h:
        return json.load(h)["health"]

# A long request, read a little, then dropped.
stream = client.completions.create(model=model, prompt="Hello", max_tokens=30000, temperature=1.0, seed=1, stream=True,
                                   extra_body={"ignore_eos": True})
chunks = iter(stream)
for _ in range(3):
    next(chunks)
busy = health()["stats"]
stream.close()
start = time.time()
while health()["stats"]["running_rows"] > 0 and time.time() - start < 30:
    time.sleep(0.01)
after = health()
out["disconnect"] = {"busy_rows": busy["running_rows"], "freed_s": time.time() - start,
                     "rows": after["stats"]["running_rows"], "requests": after["stats"]["running_requests"],
                     "completed": after["completed_requests"]}
print(json.dumps(out))
"#;

#[test]
fn streamed_answers_are_the_unstreamed_ones_and_a_disconnect_frees_the_slot() {
    let Some(python) = openai_python() else {
        eprintln!("SKIPPED: no python3 on this machine");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    // Long enough a context that the dropped request would run for minutes.
    common::tiny_byte_model(&model, 64, 32768, 3);
    let engine = EngineProcess::start(&model, &[]);
    let out = Command::new(python).args(["-c", SCRIPT, &engine.url, "tiny"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["completions", "echo", "chat"] {
        let g = &got[key];
        assert_eq!(g["streamed"], g["whole"], "{key}: the concatenated stream differs from the answer");
        assert_eq!(g["streamed_usage"], g["usage"], "{key}: usage");
    }
    let c = &got["completions"]["whole"];
    assert_eq!(c.as_object().unwrap().len(), 4, "two prompts × n = 2");
    for i in 0..4 {
        let ch = &c[i.to_string()];
        let n = ch["token_ids"].as_array().unwrap().len();
        assert!(n > 0 && ch["token_logprobs"].as_array().unwrap().len() == n, "choice {i}");
        // Two tokens, unless both print alike (byte pieces of characters print as U+FFFD).
        let top = ch["top_logprobs"][0].as_object().unwrap();
        assert!(top.len() == 2 || top.keys().any(|k| k.contains('\u{FFFD}')), "choice {i}: {top:?}");
    }
    // The two samples of a prompt draw from their own streams.
    assert_ne!(c["0"]["token_ids"], c["1"]["token_ids"]);
    assert_ne!(got["chat"]["whole"]["0"]["token_ids"], got["chat"]["whole"]["1"]["token_ids"]);
    let e = &got["echo"]["whole"]["0"];
    assert_eq!(e["token_logprobs"].as_array().unwrap().len(), 4 + 3);
    let d = &got["disconnect"];
    assert_eq!(d["busy_rows"], 1, "the long request was running: {d}");
    assert_eq!((d["rows"].as_u64(), d["requests"].as_u64()), (Some(0), Some(0)), "{d}");
    assert!(d["freed_s"].as_f64().unwrap() < 5.0, "the slot was freed late: {d}");
}
