//! Settings shared by all environments (a run config's `[env]` section).
//!
//! Every key is optional; unknown keys are rejected (serde `deny_unknown_fields`), so a typo in
//! a config file is an error rather than a silently ignored setting.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvConfig {
    /// Most model turns of a multi-turn episode (single-turn envs always take one). Default 4.
    pub max_turns: usize,
    /// Token budget of one model turn: the trainer passes it as the sampler's `max_tokens`.
    /// Default 256.
    pub max_turn_tokens: usize,
    /// Reward of a well-formed but wrong answer; `None` means the env's own default (0 for
    /// `arithmetic`, `math`, `calculator`; 0.1 for `countdown`). What "well-formed" means is
    /// in each env's docs.
    pub format_reward: Option<f64>,
    /// A system message put before every prompt; `None` means none (or, for `calculator`, its
    /// default tool instructions).
    pub system_prompt: Option<String>,
    /// Role of the tool-result messages of `calculator`. Default `user`, which every chat
    /// template renders; set `tool` for templates with a tool role (Qwen, Llama 3).
    pub tool_role: String,
}

impl Default for EnvConfig {
    fn default() -> Self {
        EnvConfig {
            max_turns: 4,
            max_turn_tokens: 256,
            format_reward: None,
            system_prompt: None,
            tool_role: "user".into(),
        }
    }
}
