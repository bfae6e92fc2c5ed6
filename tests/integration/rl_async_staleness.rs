//! The async trainer's staleness control and prompt stream (algorithms.md, "Fully async
//! staleness control"): hand-computed vectors and a property test over random finish orders,
//! filter decisions and cancels.

use oxrl::trainer::rl::prompt_stream::{PromptStream, StreamState};
use oxrl::trainer::rl::staleness::{GroupCounters, Staleness};

fn counters(submitted: u64, accepted: u64, running: u64, filtered: u64) -> GroupCounters {
    GroupCounters { submitted, accepted, running, filtered }
}

#[test]
fn capacity_follows_the_formula_step_by_step() {
    // groups_per_step 2, max_staleness 1, max_concurrent 3.
    let mut s = Staleness::new(1, 3, 2).unwrap();
    // capacity = min(3 − 0, (1 + 1)·2 − 0) = 3
    assert_eq!(s.capacity(), 3);
    assert_eq!((s.try_start(), s.try_start(), s.try_start()), (Some(1), Some(1), Some(1)));
    // min(3 − 3, 4 − 3) = 0
    assert_eq!(s.capacity(), 0);
    assert_eq!(s.try_start(), None);
    s.finish();
    // accepted 1, running 2: min(1, 4 − 3) = 1
    assert_eq!(s.counters, counters(3, 1, 2, 0));
    assert_eq!(s.capacity(), 1);
    assert_eq!(s.try_start(), Some(1));
    // running 3, accepted 1: min(0, 0) = 0
    assert_eq!(s.capacity(), 0);
    s.finish();
    s.finish();
    // accepted 3, running 1: min(2, 4 − 4) = 0 — the staleness bound binds, not concurrency
    assert_eq!(s.counters, counters(4, 3, 1, 0));
    assert_eq!(s.capacity(), 0);
    // The trainer filters one group: accepted 2, filtered 1: min(2, 4 − 3) = 1
    s.filter();
    assert_eq!(s.counters, counters(4, 2, 1, 1));
    assert_eq!(s.capacity(), 1);
    // Step 1 trains: cur 2: min(2, 3·2 − 3) = 2
    s.step_done(1);
    assert_eq!(s.cur, 2);
    assert_eq!(s.capacity(), 2);
    assert_eq!(s.try_start(), Some(2));
    // A cancel releases its capacity and leaves the counters balanced.
    s.cancel();
    assert_eq!(s.counters, counters(4, 2, 1, 1));
    assert!(s.balanced());
    assert_eq!(s.capacity(), 2);
}

#[test]
fn max_staleness_zero_admits_one_step_of_groups_at_a_time() {
    let mut s = Staleness::new(0, 100, 4).unwrap();
    let started: Vec<_> = std::iter::from_fn(|| s.try_start()).collect();
    assert_eq!(started, vec![1; 4]);
    for _ in 0..4 {
        s.finish();
    }
    assert_eq!(s.capacity(), 0, "nothing more may start before step 1 trains");
    s.step_done(1);
    assert_eq!(std::iter::from_fn(|| s.try_start()).collect::<Vec<_>>(), vec![2; 4]);
}

#[test]
fn resume_restores_the_counters_of_the_spec() {
    // Resume at step g = 3 with groups_per_step 4: cur 3, accepted = submitted = 8.
    let s = Staleness::resumed(2, 16, 4, 3).unwrap();
    assert_eq!(s.cur, 3);
    assert_eq!(s.counters, counters(8, 8, 0, 0));
    // capacity = min(16, (2 + 3)·4 − 8) = 12
    assert_eq!(s.capacity(), 12);
    assert!(Staleness::new(1, 0, 4).is_err());
    assert!(Staleness::new(1, 4, 0).is_err());
}

/// SplitMix64, for a reproducible random schedule.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random finish orders, filter decisions and cancels, with the trainer picking each step's
/// groups by `Staleness::pick`: the counters stay balanced, no group is trained staler than
/// `max_staleness`, concurrency never exceeds its bound, every prompt id is trained or filtered
/// at most once, and the run never deadlocks.
#[test]
fn random_schedules_keep_the_invariants() {
    for case in 0..3000u64 {
        let mut rng = Rng(case);
        let groups_per_step = 1 + rng.below(5);
        let max_staleness = rng.below(4);
        let max_concurrent = 1 + rng.below(12);
        let mut s = Staleness::new(max_staleness, max_concurrent, groups_per_step).unwrap();
        let mut stream = PromptStream::new(7, case, true, StreamState::default()).unwrap();
        // (id, start step) of running groups, and of finished ones the trainer holds (finish order).
        let mut running: Vec<(u64, u64)> = vec![];
        let mut finished: Vec<(u64, u64)> = vec![];
        let (mut trained_steps, mut events, mut max_seen) = (0, 0, 0);
        // Cancelled ids not handed out again yet.
        let mut released = std::collections::BTreeSet::new();
        while trained_steps < 8 {
            events += 1;
            assert!(events < 100_000, "case {case}: no progress");
            match rng.below(3) {
                0 => {
                    if let Some(step) = s.try_start() {
                        let (k, _) = stream.take();
                        assert!(k <= released.first().copied().unwrap_or(k), "case {case}: a released id comes first");
                        released.remove(&k);
                        running.push((k, step));
                    }
                }
                1 if !running.is_empty() => {
                    let g = running.swap_remove(rng.below(running.len() as u64) as usize);
                    match rng.below(10) {
                        0 => {
                            s.cancel();
                            stream.release(g.0);
                            released.insert(g.0);
                        }
                        1 | 2 => {
                            s.finish();
                            s.filter();
                            stream.filter(g.0);
                        }
                        _ => {
                            s.finish();
                            finished.push(g);
                        }
                    }
                }
                _ => {
                    let starts: Vec<u64> = finished.iter().map(|g| g.1).collect();
                    let running_starts: Vec<u64> = running.iter().map(|g| g.1).collect();
                    if let Some(mut picked) = s.pick(&starts, &running_starts) {
                        assert_eq!(picked.len() as u64, groups_per_step);
                        picked.sort_unstable_by(|a, b| b.cmp(a));
                        for i in picked {
                            let (k, start) = finished.remove(i);
                            let staleness = s.cur - start;
                            assert!(staleness <= max_staleness, "case {case}: staleness {staleness} > {max_staleness}");
                            max_seen = max_seen.max(staleness);
                            stream.consume(k);
                        }
                        trained_steps += 1;
                        s.step_done(s.cur);
                    }
                }
            }
            assert!(s.balanced(), "case {case}: {:?}", s.counters);
            assert!(s.counters.running <= max_concurrent, "case {case}");
            assert_eq!(s.counters.running, running.len() as u64, "case {case}");
            assert!(s.counters.accepted >= finished.len() as u64, "case {case}");
        }
        let state = stream.state();
        let mut all: Vec<u64> = state.consumed.iter().chain(&state.filtered).chain(&state.pending).copied().collect();
        all.extend(&released);
        all.sort();
        let n = all.len() as u64;
        assert_eq!(all, (0..n).collect::<Vec<_>>(), "case {case}: ids must be contiguous and unique");
        assert!(max_seen <= max_staleness);
    }
}

#[test]
fn pick_takes_the_oldest_and_waits_for_stragglers_that_would_grow_too_stale() {
    // max_staleness 1, groups_per_step 1, step 2: a group started in step 1 is due now.
    let mut s = Staleness::new(1, 4, 1).unwrap();
    s.step_done(1);
    // Still running: wait, even with a younger group finished.
    assert_eq!(s.pick(&[2], &[1]), None);
    // Finished after the younger one: it is picked first.
    assert_eq!(s.pick(&[2, 1], &[]), Some(vec![1]));
    // Nothing due: the young group goes; the running one (deadline 3) still fits.
    assert_eq!(s.pick(&[2], &[2]), Some(vec![0]));
    // Not enough finished.
    assert_eq!(s.pick(&[], &[2]), None);

    // max_staleness 2, groups_per_step 1, step 2: two stragglers from step 1 (deadline 3) running. Taking
    // the young group now would leave two groups for the one slot of step 3: wait.
    let mut s = Staleness::new(2, 4, 1).unwrap();
    s.step_done(1);
    assert_eq!(s.pick(&[2], &[1, 1]), None);
    // One straggler finished: it goes first, the other fits in step 3.
    assert_eq!(s.pick(&[2, 1], &[1]), Some(vec![1]));
}

#[test]
fn the_stream_hands_out_the_sync_order_and_resumes_pending_groups_first() {
    // Unshuffled: k-th group = prompt k mod n.
    let mut plain = PromptStream::new(3, 0, false, StreamState::default()).unwrap();
    assert_eq!((0..5).map(|_| plain.take()).collect::<Vec<_>>(), vec![(0, 0), (1, 1), (2, 2), (3, 0), (4, 1)]);
    // Shuffled: the data loader's per-epoch order.
    let mut loader = oxrl::trainer::DataLoader::new((0..5usize).collect(), 5, 9, true);
    let mut stream = PromptStream::new(5, 9, true, StreamState::default()).unwrap();
    let epochs: Vec<usize> = (0..3).flat_map(|_| loader.next_batch().unwrap().items).collect();
    assert_eq!((0..15).map(|_| stream.take().1).collect::<Vec<_>>(), epochs);

    // A checkpoint with 0..6 handed out: 0, 2, 3 consumed, 1 filtered, 4 and 5 pending.
    let mut s = PromptStream::new(5, 9, true, StreamState::default()).unwrap();
    for _ in 0..6 {
        s.take();
    }
    for k in [2, 0, 3] {
        s.consume(k);
    }
    s.filter(1);
    let saved = s.state();
    assert_eq!(saved, StreamState { consumed: vec![2, 0, 3], filtered: vec![1], pending: vec![4, 5] });
    let mut resumed = PromptStream::new(5, 9, true, saved).unwrap();
    assert_eq!((0..3).map(|_| resumed.take().0).collect::<Vec<_>>(), vec![4, 5, 6]);
    // A released (cancelled) group is handed out again before newer ones.
    resumed.release(5);
    assert_eq!(resumed.take().0, 5);
    assert_eq!(resumed.take().0, 7);

    let twice = StreamState { consumed: vec![1, 2], filtered: vec![2], pending: vec![] };
    let err = PromptStream::new(5, 9, true, twice).unwrap_err().to_string();
    assert!(err.contains("group 2"), "{err}");
    assert!(PromptStream::new(0, 9, true, StreamState::default()).is_err());
}
