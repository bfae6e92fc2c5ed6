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
    /// Rows let through and not yet done, in all and per key.
    rows: usize,
    per_key_rows: HashMap<Option<String>, usize>,
    /// Keys with waiting requests, in turn order.
    waiting: VecDeque<(Option<String>, KeyQueue)>,
}

pub struct FairShare {
    capacity: usize,
    per_key: usize,
    state: Mutex<State>,
}

/// A request's place in the engine: its rows are given back when it is dropped (the request
/// done, failed or cancelled), and the next waiting requests are let through.
pub struct Ticket {
    share: Arc<FairShare>,
    key: Option<String>,
    rows: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = lock(&self.share.state);
        s.rows -= self.rows;
        if let Some(r) = s.per_key_rows.get_mut(&self.key) {
            *r -= self.rows;
            if *r == 0 {
                s.per_key_rows.remove(&self.key);
            }
        }
        self.share.let_through(&mut s);
    }
}

impl FairShare {
    /// An engine of `capacity` rows, at most `per_key` of them one key's.
    pub fn new(capacity: usize, per_key: usize) -> Arc<FairShare> {
        let capacity = capacity.max(1);
        Arc::new(FairShare { capacity, per_key: per_key.clamp(1, capacity), state: Mutex::default() })
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
            let fits = s.rows + rows <= self.capacity && (key_rows + rows <= self.per_key || key_rows == 0);
            if !fits {
                queue.sessions.push_front((session, requests));
                s.waiting.push_back((key, queue));
                tried += 1;
                continue;
            }
            let waiter = requests.pop_front().expect("checked");
            s.rows += rows;
            *s.per_key_rows.entry(key.clone()).or_default() += rows;
            // The session, then the key, go to the back of their turns.
            if !requests.is_empty() {
                queue.sessions.push_back((session, requests));
            }
            if !queue.sessions.is_empty() {
                s.waiting.push_back((key.clone(), queue));
            }
            let ticket = Ticket { share: self.clone(), key, rows };
            // A waiter that gave up drops its ticket at once (in `send`'s error): its rows go
            // back through `Ticket::drop`, which cannot lock the state held here — so give
            // them back by hand instead.
            if let Err(ticket) = waiter.admit.send(ticket) {
                s.rows -= ticket.rows;
                if let Some(r) = s.per_key_rows.get_mut(&ticket.key) {
                    *r -= ticket.rows;
                    if *r == 0 {
                        s.per_key_rows.remove(&ticket.key);
                    }
                }
                std::mem::forget(ticket);
            }
            tried = 0;
        }
    }

    /// Rows let through and not yet done.
    pub fn rows_in_engine(&self) -> usize {
        lock(&self.state).rows
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
            let share = FairShare::new(128, 64);
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
    fn waiting_keys_and_sessions_take_turns() {
        run(async {
            let share = FairShare::new(1, 1);
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
            let share = FairShare::new(2, 2);
            let held = now(share.admit(tenant("a", "s"), 2)).await.unwrap();
            assert!(now(share.admit(tenant("b", "s"), 2)).await.is_none(), "no room: it waits");
            drop(held); // the given-up waiter is let through and its place given back at once
            assert_eq!(share.rows_in_engine(), 0);
            let _c = now(share.admit(tenant("c", "s"), 2)).await.expect("room again");
        });
    }
}
