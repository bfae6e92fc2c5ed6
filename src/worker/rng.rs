//! The worker's random stream, restorable from two integers.
//!
//! Each consumer (LoRA initialisation, a value head, …) takes its own `StdRng` seeded from
//! `(seed, draws)`, and `draws` counts how many were taken. The state is `(seed, draws)`: a
//! checkpoint stores both, and a restored worker continues the same stream.

use rand::rngs::StdRng;
use rand::SeedableRng;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerRng {
    pub seed: u64,
    pub draws: u64,
}

impl WorkerRng {
    pub fn new(seed: u64) -> Self {
        WorkerRng { seed, draws: 0 }
    }

    /// A fresh generator for one consumer.
    pub fn fork(&mut self) -> StdRng {
        // splitmix64 of (seed, draws): distinct, well-mixed seeds for successive forks.
        let mut z = self.seed ^ self.draws.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        self.draws += 1;
        StdRng::seed_from_u64(z ^ (z >> 31))
    }

    /// A seed for APIs that take one (e.g. `lora::attach_new`).
    pub fn next_seed(&mut self) -> u64 {
        use rand::Rng;
        self.fork().random()
    }
}
