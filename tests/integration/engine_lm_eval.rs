//! lm-evaluation-harness (pinned, installed by `.ci/run` in the venv of the tinker SDK) runs a
//! multiple-choice task and a generation task from local files (no download) through
//! `local-completions` against `oxrl engine`: each loglikelihood it reports is the sum of `oxrl
//! score`'s log-probs of the same continuation tokens, and each generation is `oxrl generate`'s
//! greedy text cut at the task's stop string.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use oxrl::model::tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::remote_engine::EngineProcess;

const LM_EVAL: &str = "lm-eval[api]==0.4.13";

/// The venv's python with lm-eval, or None when there is no Python at all.
fn lm_eval_python() -> Option<PathBuf> {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv-tinker/bin/python");
    let has = |p: &PathBuf| Command::new(p).args(["-c", "import lm_eval"]).status().is_ok_and(|s| s.success());
    if python.exists() && has(&python) {
        return Some(python);
    }
    ["python3", "python"].into_iter().find(|p| Command::new(p).arg("--version").output().is_ok())?;
    panic!("{LM_EVAL} is not installed in .venv-tinker: run `.ci/run` once, or `.venv-tinker/bin/python -m pip install '{LM_EVAL}'`");
}

const MC: &[(&str, [&str; 3])] = &[
    ("The sky is", ["blue", "green", "loud"]),
    ("Two plus two is", ["four", "five", "a fish"]),
    ("Water is", ["wet", "dry", "square"]),
    ("Cats say", ["meow", "moo", "quack"]),
    ("Hello", ["world", "there", "!"]),
];
const GEN: &[&str] = &["Hello", "Count: 1, 2,", "abc", "The quick brown fox"];
const MAX_GEN: usize = 12;

/// The two tasks' data and configs in `dir`.
fn write_tasks(dir: &Path) {
    let mc: String =
        MC.iter().map(|(q, c)| json!({"question": q, "choices": c, "answer": 0}).to_string() + "\n").collect();
    std::fs::write(dir.join("mc.jsonl"), mc).unwrap();
    let gen: String = GEN.iter().map(|q| json!({"question": q, "answer": "x"}).to_string() + "\n").collect();
    std::fs::write(dir.join("gen.jsonl"), gen).unwrap();
    let data = |f: &str| dir.join(f).display().to_string();
    std::fs::write(
        dir.join("oxrl_mc.yaml"),
        format!(
            "task: oxrl_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n\
             output_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_choice: \"{{{{choices}}}}\"\n\
             doc_to_target: \"{{{{answer}}}}\"\nmetric_list:\n  - metric: acc\n",
            data("mc.jsonl")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("oxrl_gen.yaml"),
        format!(
            "task: oxrl_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n\
             output_type: generate_until\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_target: \"{{{{answer}}}}\"\n\
             generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n\
             metric_list:\n  - metric: exact_match\n",
            data("gen.jsonl")
        ),
    )
    .unwrap();
}

/// The samples lm-eval logged for `task`, by document.
fn samples(out: &Path, task: &str) -> Vec<Value> {
    let mut files = vec![];
    for d in std::fs::read_dir(out).unwrap() {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            let p = f.unwrap().path();
            if p.file_name().unwrap().to_string_lossy().starts_with(&format!("samples_{task}_")) {
                files.push(p);
            }
        }
    }
    assert_eq!(files.len(), 1, "{task}: {files:?}");
    let mut rows: Vec<Value> =
        std::fs::read_to_string(&files[0]).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    rows.sort_by_key(|r| r["doc_id"].as_u64());
    rows
}

/// `oxrl score` of `seqs`: each sequence's log-probs (null first).
fn score(model: &Path, seqs: &[Vec<u32>]) -> Vec<Vec<Option<f64>>> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, seqs.iter().map(|s| json!({"tokens": s}).to_string() + "\n").collect::<String>()).unwrap();
    let out =
        common::oxrl_command().arg("score").arg("--model").arg(model).arg("--input").arg(&input).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["logprobs"].as_array().unwrap().iter().map(Value::as_f64).collect()
        })
        .collect()
}

/// `oxrl generate`'s greedy text for `prompt`.
fn generate(model: &Path, prompt: &str) -> String {
    let out = common::oxrl_command()
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt", prompt, "--max-tokens", &MAX_GEN.to_string(), "--temperature", "0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

#[test]
fn lm_eval_scores_through_the_engine_what_oxrl_score_and_generate_compute() {
    let Some(python) = lm_eval_python() else {
        eprintln!("SKIPPED: no python3 on this machine");
        return;
    };
    let model = common::fixture_dir("qwen3");
    let dir = tempfile::tempdir().unwrap();
    write_tasks(dir.path());
    let engine = EngineProcess::start(&model, &[]);
    let out_dir = dir.path().join("out");
    let args = format!(
        "base_url={}/v1/completions,model=qwen3,tokenizer={},tokenizer_backend=huggingface,tokenized_requests=True,\
         num_concurrent=1,max_retries=1",
        engine.url,
        model.display()
    );
    let run = Command::new(python)
        .args(["-m", "lm_eval", "run", "--model", "local-completions", "--model_args", &args, "--batch_size", "4"])
        .args(["--tasks", "oxrl_mc,oxrl_gen", "--include_path"])
        .arg(dir.path())
        .args(["--log_samples", "--output_path"])
        .arg(&out_dir)
        // Nothing is fetched: the data are local files, the tokenizer a local directory.
        .envs([("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")])
        .env("HF_HOME", dir.path().join("hf"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    // Multiple choice: each (context, continuation) as lm-eval encodes it (the continuation's
    // tokens are those of the whole text after the context's).
    let tok = Tokenizer::from_dir(&model).unwrap();
    let mc = samples(&out_dir, "oxrl_mc");
    assert_eq!(mc.len(), MC.len());
    let mut seqs = vec![];
    let mut expected = vec![];
    for (doc, (q, choices)) in mc.iter().zip(MC) {
        for (k, c) in choices.iter().enumerate() {
            let args = &doc["arguments"][format!("gen_args_{k}")];
            assert_eq!((args["arg_0"].as_str(), args["arg_1"].as_str()), (Some(*q), Some(format!(" {c}").as_str())));
            let ctx = tok.encode(q, true).unwrap().len();
            seqs.push(tok.encode(&format!("{q} {c}"), true).unwrap());
            expected.push((ctx, doc["resps"][k][0][0].as_str().unwrap().parse::<f64>().unwrap()));
        }
    }
    for (i, (lps, (ctx, got))) in score(&model, &seqs).iter().zip(expected).enumerate() {
        let want: f64 = lps[ctx..].iter().map(|l| l.unwrap()).sum();
        assert!((got - want).abs() < 1e-9, "request {i}: lm-eval {got} vs oxrl score {want}");
    }

    let gen = samples(&out_dir, "oxrl_gen");
    assert_eq!(gen.len(), GEN.len());
    for (doc, q) in gen.iter().zip(GEN) {
        let text = generate(&model, q);
        let want = text.split('\n').next().unwrap();
        assert_eq!(doc["resps"][0][0].as_str().unwrap(), want, "prompt {q:?}: oxrl generate said {text:?}");
    }
}
