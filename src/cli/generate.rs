//! `oxrl generate`: sample continuations of one prompt, one JSON line per sample, on the rollout
//! engine (sample i draws from the stream seeded with seed + i).

use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineConfig, EngineCore, Request, SamplingParams};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Prompt text (encoded by the model's tokenizer).
    #[arg(long, conflicts_with = "prompt_tokens", required_unless_present = "prompt_tokens")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_tokens: Option<Vec<u32>>,
    /// Wrap --prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f64,
    /// 0 = no top-k truncation.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f64,
    #[arg(long)]
    seed: Option<u64>,
    /// Keep going past the model's EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    n: usize,
}

pub fn run(mut a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.n > 0, "--n must be positive");
    a.model.resolve()?;
    let model = a.model.load()?;
    let tok = Tokenizer::from_dir(&a.model.model);
    // No tokenizer at all is fine with --prompt-tokens (no text is decoded); a broken one is not.
    if let Err(e) = &tok {
        if a.model.model.join("tokenizer.json").exists() {
            anyhow::bail!("{e}");
        }
    }
    let prompt = match (&a.prompt, &a.prompt_tokens) {
        (Some(text), _) => {
            let tok = tok.as_ref().map_err(|e| anyhow::anyhow!("--prompt needs the model's tokenizer: {e}"))?;
            if a.chat {
                tok.encode_chat(&[serde_json::json!({"role": "user", "content": text})], true, None)?
            } else {
                tok.encode(text, true)?
            }
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => anyhow::bail!("give --prompt or --prompt-tokens"),
    };
    let eos: Vec<u32> = match &tok {
        Ok(t) => t.eos_token_ids().to_vec(),
        Err(_) => model.config.eos_token_ids.clone(),
    };
    let params = SamplingParams {
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        stop_token_ids: vec![],
        stop_strings: vec![],
        ignore_eos: a.ignore_eos,
    };
    let mut engine = EngineCore::new(model, EngineConfig { max_batch: a.n, eos_token_ids: eos, ..Default::default() })?;
    engine.add_request(Request { num_samples: a.n, ..Request::new(prompt, params) })?;
    let (_, out) = engine.run_until_idle()?.pop().expect("one request was added");
    for g in out.samples {
        let text = match &tok {
            Ok(t) => t.decode(&g.tokens, true)?,
            Err(_) => String::new(),
        };
        println!(
            "{}",
            serde_json::json!({"tokens": g.tokens, "logprobs": g.logprobs, "stop_reason": g.stop_reason, "text": text})
        );
    }
    Ok(())
}
