//! Fair sharing of one sampling engine between tenants: requests wait here, before the engine,
//! and are let through round-robin across API keys, and across sessions within a key, so that
//! one tenant's queue of big requests never stands in front of another's small one.
//!
//! The engine decodes at most `capacity` rows (samples) at once and admits first come, first
//! served; one key may hold at most `per_key` of them (half of the engine's rows by default,
//! see [`super::samplers`]), so a key that saturates sampling leaves the other half free and
//! another key's request joins the running batch within an engine step or two instead of
//! waiting behind the first key's queue. Whatever waits is taken in turn: the key (then the
//! session) let through least recently goes first. A request of more rows than `per_key` is
//! never made (`--max-samples` is at most `per_key`).
//!
//! A request joining the running batch still pays for it: each of its tokens costs a step of
//! the whole batch. So a small request (at most `lane` rows) of a key with nothing in the
//! engine, while other keys' rows are decoding, goes to the engine's priority lane instead
//! (its own small batch, decoded in turns with the main batch by time, see
//! [`crate::rollout::engine_core`]), up to `lane` rows there at once; its tokens then cost its
//! own steps. Lane rows count against the key's share, not the main batch's capacity.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::locks::lock;

/// Who a request is for: (API key, session); `None` where there is none.
pub type Tenant = (Option<String>, Option<String>);

struct Waiter {
    rows: usize,
    admit: oneshot::Sender<Ticket>,
}

#[derive(Default)]
struct KeyQueue {
    /// Sessions with waiting requests, in turn order; each session's requests in arrival order.
    sessions: VecDeque<(Option<String>, VecDeque<Waiter>)>,
}

#[derive(Default)]
struct State {
    /// Rows let through to the main batch, to the lane, and per key (both), not yet done.
    rows: usize,
    lane_rows: usize,
    per_key_rows: HashMap<Option<String>, usize>,
    /// Keys with waiting requests, in turn order.
    waiting: VecDeque<(Option<String>, KeyQueue)>,
}

pub struct FairShare {
    capacity: usize,
    per_key: usize,
    lane: usize,
    state: Mutex<State>,
}

/// A request's place in the engine: its rows are given back when it is dropped (the request
/// done, failed or cancelled), and the next waiting requests are let through.
pub struct Ticket {
    share: Arc<FairShare>,
    key: Option<String>,
    rows: usize,
    /// Whether the request goes to the engine's priority lane.
    pub priority: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = lock(&self.share.state);
        s.give_back(self);
        self.share.let_through(&mut s);
    }
}

impl State {
    fn give_back(&mut self, t: &Ticket) {
        if t.priority {
            self.lane_rows -= t.rows;
        } else {
            self.rows -= t.rows;
        }
        if let Some(r) = self.per_key_rows.get_mut(&t.key) {
            *r -= t.rows;
            if *r == 0 {
                self.per_key_rows.remove(&t.key);
            }
        }
    }
}

impl FairShare {
    /// An engine of `capacity` rows, at most `per_key` of them one key's, and a priority lane of
    /// `lane` rows (0: none).
    pub fn new(capacity: usize, per_key: usize, lane: usize) -> Arc<FairShare> {
        let capacity = capacity.max(1);
        Arc::new(FairShare { capacity, per_key: per_key.clamp(1, capacity), lane, state: Mutex::default() })
    }

    /// Waits for `tenant`'s turn for a request of `rows` rows (at most `per_key`: more are let
    /// through alone, when the key has nothing in the engine).
    pub async fn admit(self: &Arc<Self>, (key, session): Tenant, rows: usize) -> Ticket {
        let (tx, rx) = oneshot::channel();
        {
            let mut s = lock(&self.state);
            let k = match s.waiting.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    s.waiting.push_back((key.clone(), KeyQueue::default()));
                    s.waiting.len() - 1
                }
            };
            let sessions = &mut s.waiting[k].1.sessions;
            let q = match sessions.iter().position(|(id, _)| *id == session) {
                Some(i) => i,
                None => {
                    sessions.push_back((session, VecDeque::new()));
                    sessions.len() - 1
                }
            };
            sessions[q].1.push_back(Waiter { rows, admit: tx });
            self.let_through(&mut s);
        }
        // The sender lives in the queue until it is used: the receiver always gets its ticket.
        rx.await.expect("a waiting request is always let through")
    }

    /// Lets waiting requests through, key by key in turn, while they fit.
    fn let_through(self: &Arc<Self>, s: &mut State) {
        let mut tried = 0;
        while tried < s.waiting.len() {
            let (key, mut queue) = s.waiting.pop_front().expect("non-empty");
            let (session, mut requests) = queue.sessions.pop_front().expect("a waiting key has a session");
            let rows = requests.front().expect("a waiting session has a request").rows;
            let key_rows = s.per_key_rows.get(&key).copied().unwrap_or(0);
            let priority = key_rows == 0 && s.rows > 0 && s.lane_rows + rows <= self.lane;
            let fits =
                priority || (s.rows + rows <= self.capacity && (key_rows + rows <= self.per_key || key_rows == 0));
            if !fits {
                queue.sessions.push_front((session, requests));
                s.waiting.push_back((key, queue));
                tried += 1;
                continue;
            }
            let waiter = requests.pop_front().expect("checked");
            if priority {
                s.lane_rows += rows;
            } else {
                s.rows += rows;
            }
            *s.per_key_rows.entry(key.clone()).or_default() += rows;
            // The session, then the key, go to the back of their turns.
            if !requests.is_empty() {
                queue.sessions.push_back((session, requests));
            }
            if !queue.sessions.is_empty() {
                s.waiting.push_back((key.clone(), queue));
            }
            let ticket = Ticket { share: self.clone(), key, rows, priority };
            // A waiter that gave up drops its ticket at once (in `send`'s error): its rows go
            // back through `Ticket::drop`, which cannot lock the state held here — so give
            // them back by hand instead.
            if let Err(ticket) = waiter.admit.send(ticket) {
                s.give_back(&ticket);
                std::mem::forget(ticket);
            }
            tried = 0;
        }
    }

    /// Rows let through and not yet done (main batch and lane).
    pub fn rows_in_engine(&self) -> usize {
        let s = lock(&self.state);
        s.rows + s.lane_rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn tenant(key: &str, session: &str) -> Tenant {
        (Some(key.into()), Some(session.into()))
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    }

    /// Whether `f` completes without waiting.
    async fn now<F: std::future::Future>(f: F) -> Option<F::Output> {
        tokio::time::timeout(Duration::from_millis(20), f).await.ok()
    }

    #[test]
    fn a_saturating_key_leaves_room_and_another_key_goes_first() {
        run(async {
            let share = FairShare::new(128, 64, 0);
            let a1 = now(share.admit(tenant("a", "s"), 64)).await.expect("room");
            // a's second waits (a holds its share) though the engine has room...
            let s2 = share.clone();
            let a2 = tokio::spawn(async move { s2.admit(tenant("a", "s"), 64).await });
            tokio::task::yield_now().await;
            assert_eq!(share.rows_in_engine(), 64);
            // ...which b's small request takes at once.
            let b1 = now(share.admit(tenant("b", "s"), 8)).await.expect("b goes past a's queue");
            assert_eq!(share.rows_in_engine(), 72);
            drop(a1);
            let a2 = a2.await.unwrap();
            assert_eq!(share.rows_in_engine(), 72);
            drop((a2, b1));
            assert_eq!(share.rows_in_engine(), 0);
        });
    }

    #[test]
    fn a_small_request_beside_another_keys_rows_takes_the_lane() {
        run(async {
            let share = FairShare::new(2, 2, 1);
            // Alone: the main batch (nothing to jump ahead of).
            let b0 = now(share.admit(tenant("b", "s"), 1)).await.unwrap();
            assert!(!b0.priority);
            drop(b0);
            let a = now(share.admit(tenant("a", "s"), 2)).await.unwrap();
            assert!(!a.priority);
            // The engine is full with a's rows: b's small request takes the lane, c's one too
            // big for it waits for the main batch.
            let b = now(share.admit(tenant("b", "s"), 1)).await.expect("the lane");
            assert!(b.priority);
            assert_eq!(share.rows_in_engine(), 3);
            assert!(now(share.admit(tenant("c", "s"), 2)).await.is_none());
            // A key with rows in the engine never takes the lane.
            drop(b);
            let s2 = share.clone();
            let a2 = tokio::spawn(async move { s2.admit(tenant("a", "s"), 1).await });
            tokio::task::yield_now().await;
            assert_eq!(share.rows_in_engine(), 2, "a's second request waits for its share");
            drop(a);
            assert!(!a2.await.unwrap().priority);
        });
    }

    #[test]
    fn waiting_keys_and_sessions_take_turns() {
        run(async {
            let share = FairShare::new(1, 1, 0);
            let first = now(share.admit(tenant("a", "s1"), 1)).await.unwrap();
            // Queued in this order: a/s1 ×2, a/s2, b/s ×2. Turns: keys alternate (a, b, a, b …)
            // and a's sessions alternate (s1, s2, s1).
            let order = Arc::new(Mutex::new(vec![]));
            let mut tasks = vec![];
            for (i, (key, session)) in
                [("a", "s1"), ("a", "s1"), ("a", "s2"), ("b", "s"), ("b", "s")].into_iter().enumerate()
            {
                let (share, order) = (share.clone(), order.clone());
                tasks.push(tokio::spawn(async move {
                    let t = share.admit(tenant(key, session), 1).await;
                    lock(&order).push(i);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    drop(t);
                }));
                tokio::task::yield_now().await;
            }
            drop(first);
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(*lock(&order), vec![0, 3, 2, 4, 1]);
        });
    }

    #[test]
    fn a_waiter_that_gives_up_frees_its_place() {
        run(async {
            let share = FairShare::new(2, 2, 0);
            let held = now(share.admit(tenant("a", "s"), 2)).await.unwrap();
            assert!(now(share.admit(tenant("b", "s"), 2)).await.is_none(), "no room: it waits");
            drop(held); // the given-up waiter is let through and its place given back at once
            assert_eq!(share.rows_in_engine(), 0);
            let _c = now(share.admit(tenant("c", "s"), 2)).await.expect("room again");
        });
    }
}
