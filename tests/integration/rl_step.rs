//! One RL step's numbers against a hand computation on a 2-prompt batch (2 episodes each):
//! KL in the reward, GRPO advantages, token-mean weights, token-level truncated IS, and the
//! datums the worker receives; then the KL-in-the-loss and prompt-mean variants.

use oxrl::algo::{AdvantageEstimator, KlEstimator, LossReduction, OffPolicyCorrection};
use oxrl::env::TrainingSequence;
use oxrl::trainer::rl::episodes::Episode;
use oxrl::trainer::rl::step::{minibatches, policy_datums, prepare, StepRecipe};
use serde_json::json;

/// Prompt position 0, sampled positions 1..=3 (mask [0, 1, 1, 1]).
fn episode(group: usize, reward: f64, sampler: [f32; 3]) -> Episode {
    Episode {
        group,
        uid: format!("p{group}"),
        sequence: TrainingSequence {
            input_tokens: vec![10, 11, 12, 13],
            target_tokens: vec![11, 12, 13, 14],
            mask: vec![0.0, 1.0, 1.0, 1.0],
            logprobs: vec![0.0, sampler[0], sampler[1], sampler[2]],
            turn: vec![None, Some(0), Some(0), Some(0)],
        },
        reward,
        correct: reward > 0.5,
        truncated: false,
        turns: 1,
        response_tokens: 3,
        min_version: 0,
        versions: vec![],
        data_source: None,
        reward_metrics: Default::default(),
        user_error: false,
    }
}

fn close(a: &[f32], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (t, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((*x as f64 - y).abs() < 1e-5, "{what}[{t}]: {x} vs hand {y}");
    }
}

fn recorded_step() -> (Vec<Episode>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let episodes = vec![
        episode(0, 1.0, [-1.0, -0.5, -0.2]),
        episode(0, 0.0, [-0.7, -0.3, -0.9]),
        episode(1, 1.0, [-0.2, -0.2, -0.2]),
        episode(1, 1.0, [-0.4, -0.1, -0.6]),
    ];
    // The step's recomputed log-probs (`old`) and the reference's: old − ref = 0.1 everywhere.
    let old = vec![
        vec![0.0, -1.1, -0.4, -0.2],
        vec![0.0, -0.7, -0.5, -0.9],
        vec![0.0, -0.2, -0.2, -0.3],
        vec![0.0, -0.4, -0.1, -0.6],
    ];
    let reference = old.iter().map(|r| r.iter().map(|x| x - 0.1).collect()).collect();
    (episodes, old, reference)
}

#[test]
fn one_step_equals_a_hand_computation() {
    let (episodes, old, reference) = recorded_step();
    let recipe = StepRecipe {
        advantage: AdvantageEstimator::Grpo { norm_by_std: true },
        reduction: LossReduction::TokenMean,
        kl_coef: 0.5,
        kl_estimator: KlEstimator::K1,
        kl_in_reward: true,
        off_policy: Some(OffPolicyCorrection::from_config(&json!({"tis_level": "token", "tis_cap": 2.0})).unwrap()),
    };
    let prep = prepare(&recipe, &episodes, old.clone(), Some(reference), None).unwrap();

    // KL (k1 = old − ref = 0.1 per sampled token) in the reward: −0.05 at each of 3 tokens.
    assert!((prep.metrics.reduce()["kl:mean"] - 0.1).abs() < 1e-6);
    close(&prep.token_rewards[0], &[0.0, -0.05, -0.05, 0.95], "token rewards of episode 0");
    close(&prep.token_rewards[1], &[0.0, -0.05, -0.05, -0.05], "token rewards of episode 1");
    // GRPO: scores 0.85, −0.15 (group 0) and 0.85, 0.85 (group 1); μ0 = 0.35, σ0 (n−1) = √0.5.
    let a0 = 0.5 / (0.5f64.sqrt() + 1e-6);
    close(&prep.advantages[0], &[0.0, a0, a0, a0], "advantages of episode 0");
    close(&prep.advantages[1], &[0.0, -a0, -a0, -a0], "advantages of episode 1");
    close(&prep.advantages[2], &[0.0, 0.0, 0.0, 0.0], "advantages of episode 2 (no variance)");
    // Token TIS: min(exp(old − roll), 2).
    let rho = |o: f64, r: f64| (o - r).exp().min(2.0);
    close(&prep.is_weights[0], &[0.0, rho(-1.1, -1.0), rho(-0.4, -0.5), rho(-0.2, -0.2)], "IS weights of episode 0");
    close(&prep.is_weights[2], &[0.0, 1.0, 1.0, rho(-0.3, -0.2)], "IS weights of episode 2");

    // One mini-batch of both groups: token mean over 12 sampled tokens, times the IS weight.
    let batches = minibatches(&episodes, 1);
    assert_eq!(batches, vec![vec![0, 1, 2, 3]]);
    let datums = policy_datums(&recipe, &episodes, &prep, &batches[0]).unwrap();
    let d = &datums[0].loss_fn_inputs;
    let w = 1.0 / 12.0;
    close(
        d.weights.as_ref().unwrap(),
        &[0.0, w * rho(-1.1, -1.0), w * rho(-0.4, -0.5), w * rho(-0.2, -0.2)],
        "weights of episode 0",
    );
    close(d.logprobs.as_ref().unwrap(), &[0.0, -1.1, -0.4, -0.2], "anchor log-probs");
    close(d.rollout_logprobs.as_ref().unwrap(), &[0.0, -1.0, -0.5, -0.2], "sampler log-probs");
    close(d.advantages.as_ref().unwrap(), &[0.0, a0, a0, a0], "datum advantages");
    assert_eq!(d.ref_logprobs, None, "KL in the reward: no KL term in the loss");
    assert_eq!(datums[0].input_tokens, vec![10, 11, 12, 13]);
}

#[test]
fn kl_in_the_loss_and_prompt_mean_over_two_mini_batches() {
    let (episodes, old, reference) = recorded_step();
    let recipe = StepRecipe {
        advantage: AdvantageEstimator::Rloo,
        reduction: LossReduction::PromptMean,
        kl_coef: 0.5,
        kl_estimator: KlEstimator::K3,
        kl_in_reward: false,
        off_policy: None,
    };
    let prep = prepare(&recipe, &episodes, old, Some(reference.clone()), None).unwrap();
    // Rewards untouched; RLOO on scores [1, 0 | 1, 1]: (s − μ)·n/(n − 1) = ±1, then 0, 0.
    close(&prep.advantages[0], &[0.0, 1.0, 1.0, 1.0], "rloo episode 0");
    close(&prep.advantages[1], &[0.0, -1.0, -1.0, -1.0], "rloo episode 1");
    close(&prep.advantages[3], &[0.0, 0.0, 0.0, 0.0], "rloo episode 3");
    // k3 of Δ = 0.1: e^{−0.1} + 0.1 − 1.
    let k3 = (-0.1f64).exp() + 0.1 - 1.0;
    assert!((prep.metrics.reduce()["kl:mean"] - k3).abs() < 1e-6);
    // Two mini-batches, one group each: prompt mean = 1 / (1 prompt · 6 tokens).
    let batches = minibatches(&episodes, 2);
    assert_eq!(batches, vec![vec![0, 1], vec![2, 3]]);
    for members in &batches {
        let datums = policy_datums(&recipe, &episodes, &prep, members).unwrap();
        for (d, &i) in datums.iter().zip(members) {
            close(d.loss_fn_inputs.weights.as_ref().unwrap(), &[0.0, 1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0], "prompt mean");
            let r: Vec<f64> = reference[i].iter().map(|&x| x as f64).collect();
            close(d.loss_fn_inputs.ref_logprobs.as_ref().unwrap(), &r, "reference log-probs for the KL term");
        }
    }
}
