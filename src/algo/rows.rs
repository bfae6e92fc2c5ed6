//! Shape checks for host batches laid out as one row per sequence.

use std::collections::HashMap;
use std::hash::Hash;

use crate::{Error, Result};

/// Checks that `b` has as many rows as `a`, each of the same length.
pub(crate) fn check_same_layout(a_name: &str, a: &[Vec<f32>], b_name: &str, b: &[Vec<f32>]) -> Result<()> {
    if a.len() != b.len() {
        return Err(Error::input(format!("`{a_name}` has {} sequences but `{b_name}` has {}", a.len(), b.len())));
    }
    for (i, (ra, rb)) in a.iter().zip(b).enumerate() {
        if ra.len() != rb.len() {
            return Err(Error::input(format!(
                "sequence {i}: `{a_name}` has {} tokens but `{b_name}` has {}",
                ra.len(),
                rb.len()
            )));
        }
    }
    Ok(())
}

/// Checks that there is one group id per sequence.
pub(crate) fn check_group_count<G>(sequences: usize, groups: &[G]) -> Result<()> {
    if groups.len() != sequences {
        return Err(Error::input(format!("{} group ids for {sequences} sequences", groups.len())));
    }
    Ok(())
}

/// The members (sequence indices) of each group, groups in order of first appearance.
pub(crate) fn group_members<G: Eq + Hash>(groups: &[G]) -> Vec<Vec<usize>> {
    let mut index: HashMap<&G, usize> = HashMap::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let k = *index.entry(g).or_insert_with(|| {
            members.push(Vec::new());
            members.len() - 1
        });
        members[k].push(i);
    }
    members
}

/// A token is valid when its mask entry is non-zero.
pub(crate) fn is_valid(m: f32) -> bool {
    m != 0.0
}
