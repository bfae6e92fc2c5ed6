//! Per-prompt token budgets: a prompt row's optional `max_tokens` caps every turn of its
//! episodes at min(row `max_tokens`, `env.max_turn_tokens`), and a bad value is a `file:line`
//! error naming the field.

use crate::common;

use std::cell::RefCell;
use std::io::Write;

use oxrl::env::{load_prompts, EnvConfig, EnvFactory, PromptOptions};
use oxrl::handle::Handle;
use oxrl::model::tokenizer::Tokenizer;
use oxrl::rollout::{Generation, Request, RequestOutput, SamplingParams, StopReason};
use oxrl::trainer::rl::episodes::{generate_episodes, TurnSampler};
use oxrl::trainer::sections::OnBadRow;

fn jsonl(lines: &[&str]) -> tempfile::TempPath {
    let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    for line in lines {
        writeln!(f, "{line}").unwrap();
    }
    f.into_temp_path()
}

fn options(on_bad_row: OnBadRow) -> PromptOptions {
    PromptOptions { default_env: Some("calculator".into()), on_bad_row, config: EnvConfig::default() }
}

/// Replies to a request with a tool call first and the answer to a later turn of the same
/// prompt, and records every request.
struct Script {
    tok: Tokenizer,
    calls: RefCell<Vec<Request>>,
}

impl TurnSampler for Script {
    fn submit(&self, req: Request) -> Handle<RequestOutput> {
        let first_turn = req.num_samples > 1 || !self.calls.borrow().iter().any(|c| req.prompt.starts_with(&c.prompt));
        let text = if first_turn { "<calc>1+1</calc>" } else { "Answer: 2" };
        let mut tokens = self.tok.encode(text, false).unwrap();
        tokens.push(self.tok.token_to_id("<|im_end|>").unwrap());
        let g = Generation {
            logprobs: vec![-0.5; tokens.len()],
            versions: vec![0; tokens.len()],
            tokens,
            topk: vec![],
            stop_reason: StopReason::Stop,
        };
        let out = RequestOutput { samples: vec![g; req.num_samples], prompt_logprobs: None, prompt_topk: None };
        self.calls.borrow_mut().push(req);
        Handle::ready(Ok(out))
    }
}

#[test]
fn a_rows_max_tokens_caps_each_of_its_turns() {
    let path = jsonl(&[
        r#"{"prompt": "What is 1 + 1? a", "answer": 2, "max_tokens": 4}"#,
        r#"{"prompt": "What is 1 + 1? b", "answer": 2, "max_tokens": 100}"#,
        r#"{"prompt": "What is 1 + 1? c", "answer": 2}"#,
    ]);
    let set = load_prompts(&path, &options(OnBadRow::Error)).unwrap();
    let budgets: Vec<Option<usize>> = set.rows.iter().map(|p| p.max_tokens()).collect();
    assert_eq!(budgets, [Some(4), Some(100), None]);

    let tmp = tempfile::tempdir().unwrap();
    common::tiny_byte_model(tmp.path(), 16, 512, 1);
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let script = Script { tok: Tokenizer::from_dir(tmp.path()).unwrap(), calls: RefCell::new(vec![]) };
    let cfg = EnvConfig { max_turns: 3, max_turn_tokens: 32, ..Default::default() };
    let episodes = generate_episodes(
        &script,
        &tok,
        &set.rows,
        &EnvFactory::builtin(cfg.clone()),
        &SamplingParams::default(),
        1,
        0,
    )
    .unwrap();
    assert!(episodes.iter().all(|e| e.turns == 2), "two turns each");
    // First turns in prompt order, then the second turns in episode order.
    let got: Vec<usize> = script.calls.borrow().iter().map(|c| c.params.max_tokens).collect();
    assert_eq!(got, [4, 32, 32, 4, 32, 32], "min(row max_tokens, env.max_turn_tokens) on every turn");
}

#[test]
fn a_bad_max_tokens_is_an_error_at_file_line_naming_the_field() {
    for bad in ["0", "-3", "2.5", "\"8\"", "[8]"] {
        let row = format!(r#"{{"prompt": "p", "answer": 1, "max_tokens": {bad}}}"#);
        let path = jsonl(&[r#"{"prompt": "What is 1 + 1?", "answer": 2, "max_tokens": 8}"#, &row]);
        let e = load_prompts(&path, &options(OnBadRow::Error)).unwrap_err().to_string();
        let want = format!("{}:2: field `max_tokens`: must be a positive integer", path.display());
        assert!(e.contains(&want), "{bad}: {e}");
        // Skipped like any other bad row.
        let set = load_prompts(&path, &options(OnBadRow::Skip)).unwrap();
        assert_eq!((set.rows.len(), set.bad_rows), (1, 1));
    }
}
