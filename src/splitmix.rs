//! SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators", OOPSLA
//! 2014), the one small generator behind oxrl's own seed streams: the per-epoch shuffle and the
//! eval split (`trainer::data_loader`), the per-prompt and per-turn sampling seeds
//! (`trainer::rl::episodes`), and the seeds a worker hands to each consumer (`worker::rng`).
//!
//! We own it rather than borrow a crate's: these streams are part of checkpoints and of run
//! reproducibility (a resumed run must shuffle, split and seed exactly as the original did), so
//! their bits must not change with a dependency's version. The test below pins them.
//!
//! The state advances by the golden-ratio increment [`GOLDEN`]; each output is the state passed
//! through the finaliser [`mix`] (a variant of MurmurHash3's `fmix64`, Stafford's "Mix13").

/// The state increment: 2^64 / φ, odd.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Advances `state` by [`GOLDEN`] and returns the next output, [`mix`] of the new state.
pub fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN);
    mix(*state)
}

/// The SplitMix64 finaliser: a bijection of `u64` that spreads every input bit over the output.
pub fn mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outputs(seed: u64) -> [u64; 3] {
        let mut s = seed;
        [next(&mut s), next(&mut s), next(&mut s)]
    }

    #[test]
    fn published_reference_from_state_zero() {
        // The reference implementation (Vigna's splitmix64.c, and Java's SplittableRandom) from
        // state 0.
        assert_eq!(outputs(0), [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f]);
    }

    #[test]
    fn streams_are_those_of_the_three_former_copies() {
        // Computed with the three hand-written copies this module replaced (data_loader's
        // `splitmix64`, rollouts' `prompt_seed`, `WorkerRng::fork`), before the change.
        assert_eq!(outputs(1), [0x910a2dec89025cc1, 0xbeeb8da1658eec67, 0xf893a2eefb32555e]);
        assert_eq!(outputs(42), [0xbdd732262feb6e95, 0x28efe333b266f103, 0x47526757130f9f52]);
        assert_eq!(outputs(0xdead_beef), [0x4adfb90f68c9eb9b, 0xde586a3141a10922, 0x021fbc2f8e1cfc1d]);
        assert_eq!(outputs(u64::MAX), [0xe4d971771b652c20, 0xe99ff867dbf682c9, 0x382ff84cb27281e9]);
        // `mix` alone, as `WorkerRng::fork` uses it: mix(seed ^ (draws + 1)·GOLDEN).
        assert_eq!(mix(42 ^ 2u64.wrapping_mul(GOLDEN)), 0xd9639a006c85adb0);
        assert_eq!(mix(u64::MAX ^ GOLDEN), 0xde0a564cbcd060c4);
        assert_eq!(mix(u64::MAX ^ 3u64.wrapping_mul(GOLDEN)), 0x8f33834013b31f7c);
    }

    #[test]
    fn next_is_mix_of_the_advanced_state() {
        for seed in [0u64, 1, 42, u64::MAX] {
            let mut s = seed;
            assert_eq!(next(&mut s), mix(seed.wrapping_add(GOLDEN)));
            assert_eq!(s, seed.wrapping_add(GOLDEN));
        }
    }
}
