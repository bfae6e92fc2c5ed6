//! Sliding-window attention (Gemma 3's local layers): which keys a query sees, and which cached
//! keys a later query can still see.
//!
//! A query sees a key when the causal mask lets it and the key is among the last `window` real
//! tokens of its row up to the query (itself included): counting real tokens rather than columns
//! makes the window independent of padding, so a row batched with others (left-padded, or with
//! padding between its tokens) sees what it sees alone. With positions numbered by the real
//! tokens (`cumsum(mask) − 1`, as everywhere here) this is transformers' rule,
//! `position(query) − position(key) < window`.
//!
//! The decode cache keeps, for a sliding layer, only the columns a later query can see: the last
//! `window − 1` real keys of each row ([`needed_columns`]). The attention kernel adds its
//! products key by key and a masked key's probability is exactly 0, so attending over the kept
//! columns gives the bits of the trainer's full forward with the window as a mask.

use candle_core::{Device, Tensor};

use crate::Result;

/// The additive bias [B, T, S] of a sliding layer for `t` new queries after `past` cached
/// columns: [`super::transformer::attention_bias`]'s rule with the window on top.
pub fn attention_bias(key_mask: &[Vec<u8>], past: usize, t: usize, window: usize, device: &Device) -> Result<Tensor> {
    let b = key_mask.len();
    let s = past + t;
    let mut bias = vec![super::transformer::MASKED; b * t * s];
    for (row, mask) in key_mask.iter().enumerate() {
        for i in 0..t {
            let q = past + i;
            let out = &mut bias[(row * t + i) * s..(row * t + i + 1) * s];
            out[q] = 0.0;
            // Real tokens in (j, q], counted as j walks back from the query.
            let mut seen = 0;
            for j in (0..q).rev() {
                seen += usize::from(mask[j + 1] != 0);
                if seen >= window {
                    break;
                }
                if mask[j] != 0 {
                    out[j] = 0.0;
                }
            }
        }
    }
    Ok(Tensor::from_vec(bias, (b, t, s), device)?)
}

/// The trailing columns of a cache with key mask `key_mask` that a later query of a sliding
/// layer can still see: each row's last `window − 1` real keys (all of them when it has fewer).
/// At least one column, so that a layer never holds an empty tensor.
pub fn needed_columns(key_mask: &[Vec<u8>], window: usize) -> usize {
    let s = key_mask.first().map_or(0, Vec::len);
    let keep = window.saturating_sub(1);
    let first_needed = key_mask
        .iter()
        .map(|row| {
            let mut real = 0;
            let mut first = s;
            for j in (0..row.len()).rev() {
                if real == keep {
                    break;
                }
                if row[j] != 0 {
                    real += 1;
                    first = j;
                }
            }
            first
        })
        .min()
        .unwrap_or(s);
    (s - first_needed).max(1).min(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(bias: &Tensor) -> Vec<Vec<Vec<u8>>> {
        let v = bias.to_vec3::<f32>().unwrap();
        v.into_iter()
            .map(|r| r.into_iter().map(|q| q.into_iter().map(|x| u8::from(x == 0.0)).collect()).collect())
            .collect()
    }

    #[test]
    fn a_query_sees_the_last_window_real_tokens() {
        // Row 0: 6 real tokens; row 1: two pads, a real token, a pad, four real.
        let mask = vec![vec![1, 1, 1, 1, 1, 1, 1, 1], vec![0, 0, 1, 0, 1, 1, 1, 1]];
        let v = visible(&attention_bias(&mask, 0, 8, 3, &Device::Cpu).unwrap());
        assert_eq!(v[0][7], vec![0, 0, 0, 0, 0, 1, 1, 1]);
        assert_eq!(v[0][2], vec![1, 1, 1, 0, 0, 0, 0, 0]);
        assert_eq!(v[1][5], vec![0, 0, 1, 0, 1, 1, 0, 0]);
        assert_eq!(v[1][6], vec![0, 0, 0, 0, 1, 1, 1, 0]);
        // A pad query sees itself.
        assert_eq!(v[1][3], vec![0, 0, 1, 1, 0, 0, 0, 0]);
        // Queries after a cache: the same rows.
        let v2 = visible(&attention_bias(&mask, 6, 2, 3, &Device::Cpu).unwrap());
        assert_eq!(v2[1][0], v[1][6]);
    }

    #[test]
    fn needed_columns_cover_every_rows_last_real_keys() {
        let mask = vec![vec![1, 1, 1, 1, 1, 1, 1, 1], vec![0, 0, 1, 0, 1, 1, 0, 1]];
        assert_eq!(needed_columns(&mask, 3), 3); // row 1's last two real keys start at column 5
        assert_eq!(needed_columns(&mask, 4), 4);
        assert_eq!(needed_columns(&mask, 5), 6);
        assert_eq!(needed_columns(&mask, 100), 8);
        assert_eq!(needed_columns(&mask, 1), 1);
    }
}
