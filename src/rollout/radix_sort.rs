//! A stable LSD radix sort of u64 keys by their high 32 bits: one counting pass per byte, bytes
//! every key shares skipped (all the histograms come from one first pass).
//!
//! The sampler sorts a whole vocabulary when top-p's nucleus is most of a flat row. Its keys are
//! (weight bits above, id below) built in id order, so ordering them by the high half, stably,
//! is the full order. About twice as fast as `sort_unstable` of the keys on a flat 152k row's
//! top-p draw (`cargo bench --bench kernels sampler`, BENCHMARKS.md). Tried and slower: the
//! `radsort` crate (byte digits over all 64 bits), and 11-bit digits over all 64 bits (2,048
//! buckets scatter their writes over more lines than L1 holds).

/// Sorts `keys` by `key >> 32`, keeping the order of keys with equal high halves (so ascending
/// for keys whose low halves already ascend within each high half, e.g. in id order).
pub fn sort_by_high_half(keys: &mut [u64]) {
    let n = keys.len();
    let mut counts = [[0usize; 256]; 4];
    for &k in keys.iter() {
        for (b, c) in counts.iter_mut().enumerate() {
            c[byte(k, b)] += 1;
        }
    }
    let mut other = vec![0u64; n];
    let mut in_other = false; // whether the latest pass wrote `other`
    for (b, c) in counts.iter().enumerate() {
        if c.contains(&n) {
            continue; // every key has the same byte here
        }
        let mut starts = [0usize; 256];
        let mut at = 0;
        for (s, &x) in starts.iter_mut().zip(c.iter()) {
            *s = at;
            at += x;
        }
        let (src, dst): (&[u64], &mut [u64]) = if in_other { (&other, keys) } else { (keys, &mut other) };
        for &k in src {
            let d = byte(k, b);
            dst[starts[d]] = k;
            starts[d] += 1;
        }
        in_other = !in_other;
    }
    if in_other {
        keys.copy_from_slice(&other);
    }
}

/// Byte `b` (0 = lowest) of the key's high half.
fn byte(key: u64, b: usize) -> usize {
    ((key >> (32 + 8 * b)) & 0xFF) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_keys_with_ascending_ids_as_sort_unstable() {
        // Keys as the sampler builds them (a weight's bits above an id, in id order): ties in the
        // high half, one high half for all, spread high halves; lengths 0 to a vocabulary.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in [0, 1, 2, 255, 256, 5000, 151_936] {
            for kind in 0..3 {
                let mut keys: Vec<u64> = (0..n as u64)
                    .map(|i| {
                        let high = match kind {
                            0 => next() % 97,
                            1 => 7,
                            _ => next() >> 32,
                        };
                        (high << 32) | i
                    })
                    .collect();
                let mut want = keys.clone();
                want.sort_unstable();
                sort_by_high_half(&mut keys);
                assert_eq!(keys, want, "n {n} kind {kind}");
            }
        }
    }
}
