//! `oxrl score`: per-token log-probs of JSONL sequences, in input order.
//!
//! Input lines are `{"tokens": [...]}` or `{"text": "..."}`; output lines are
//! `{"tokens": [...], "logprobs": [null, lp1, ...]}` with lp_i = log p(tokens[i] | tokens[..i]).
//! Sequences are scored in right-padded batches of `--batch-size`, through the trainer's forward
//! (`model::sequence_logprobs`): the bits a training step and the engine compute for each token.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;

use crate::model::{sequence_logprobs::sequence_logprobs, tokenizer::Tokenizer, Transformer};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// JSONL input file; `-` for standard input.
    #[arg(long)]
    input: PathBuf,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
}

/// log p(seq[i] | seq[..i]) for each sequence, through the trainer's forward
/// ([`sequence_logprobs`]); the first entry of each is None.
pub fn score_sequences(model: &Transformer, seqs: &[Vec<u32>]) -> crate::Result<Vec<Vec<Option<f32>>>> {
    Ok(sequence_logprobs(model, seqs)?
        .into_iter()
        .map(|row| std::iter::once(None).chain(row.into_iter().map(Some)).collect())
        .collect())
}

fn parse_line(
    line: &str,
    n: usize,
    tok: &mut Option<Tokenizer>,
    model_dir: &std::path::Path,
) -> anyhow::Result<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("line {n}: invalid JSON"))?;
    let tokens = if let Some(ts) = v.get("tokens") {
        let ts = ts.as_array().with_context(|| format!("line {n}: `tokens` must be an array of token ids"))?;
        ts.iter()
            .map(|x| x.as_u64().filter(|&x| x <= u32::MAX as u64).map(|x| x as u32))
            .collect::<Option<Vec<u32>>>()
            .with_context(|| format!("line {n}: `tokens` must hold non-negative integers"))?
    } else if let Some(text) = v.get("text") {
        let text = text.as_str().with_context(|| format!("line {n}: `text` must be a string"))?;
        if tok.is_none() {
            *tok = Some(Tokenizer::from_dir(model_dir)?);
        }
        tok.as_ref().unwrap().encode(text, true)?
    } else {
        anyhow::bail!("line {n}: expected an object with `tokens` or `text`");
    };
    anyhow::ensure!(!tokens.is_empty(), "line {n}: empty sequence");
    Ok(tokens)
}

pub fn run(mut a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.batch_size > 0, "--batch-size must be positive");
    a.model.resolve()?;
    let model = a.model.load()?;
    let reader: Box<dyn BufRead> = if a.input.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(&a.input).with_context(|| format!("{}: cannot open", a.input.display()))?,
        ))
    };
    let mut tok = None;
    let mut seqs = vec![];
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("{}: read error", a.input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let tokens =
            parse_line(&line, i + 1, &mut tok, &a.model.model).with_context(|| a.input.display().to_string())?;
        seqs.push((i + 1, tokens));
    }
    let limit = model.config.max_position_embeddings;
    for (n, s) in &seqs {
        anyhow::ensure!(
            s.len() <= limit,
            "{}: line {n}: {} tokens exceed max_position_embeddings {limit}",
            a.input.display(),
            s.len()
        );
        crate::model::check_token_ids(s, model.config.vocab_size, format_args!("{}: line {n}", a.input.display()))?;
    }
    let mut out = std::io::stdout().lock();
    for chunk in seqs.chunks(a.batch_size) {
        let batch: Vec<Vec<u32>> = chunk.iter().map(|(_, s)| s.clone()).collect();
        for (s, lp) in batch.iter().zip(score_sequences(&model, &batch)?) {
            writeln!(out, "{}", serde_json::json!({"tokens": s, "logprobs": lp}))?;
        }
    }
    Ok(())
}
