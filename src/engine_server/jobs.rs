//! The engine requests of one OpenAI request (one per prompt), run together: their events —
//! each decode step's new tokens when watched, then each request's output — arrive on one
//! channel in the order the engine produced them. Dropping the [`Jobs`] (the answer was sent,
//! or the client hung up and its handler or stream was dropped) cancels whatever still runs,
//! so a departed client's rows leave the batch at the next step.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::EngineServer;
use crate::rollout::engine::{Delta, Ticket};
use crate::rollout::{Request, RequestOutput};

pub enum Event {
    /// New tokens of one sample of request `.0`.
    Delta(usize, Delta),
    /// Request `.0` ended.
    Done(usize, crate::Result<RequestOutput>),
}

pub struct Jobs {
    rx: mpsc::UnboundedReceiver<Event>,
    server: Arc<EngineServer>,
    tickets: Vec<Ticket>,
    left: usize,
}

/// Submits `reqs`; with `watch`, each decode step's new tokens come as [`Event::Delta`].
pub fn submit(s: &Arc<EngineServer>, reqs: Vec<Request>, watch: bool) -> Jobs {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut tickets = vec![];
    let left = reqs.len();
    for (i, req) in reqs.into_iter().enumerate() {
        let ticket = s.engine.new_ticket();
        tickets.push(ticket);
        let done = tx.clone();
        let sink = Box::new(move |out| drop(done.send(Event::Done(i, out))));
        let watcher = watch.then(|| {
            let deltas = tx.clone();
            Box::new(move |d| drop(deltas.send(Event::Delta(i, d)))) as crate::rollout::engine::Watcher
        });
        s.engine.submit_watched(ticket, req, sink, watcher);
    }
    Jobs { rx, server: s.clone(), tickets, left }
}

impl Jobs {
    /// The next event; None once every request has ended.
    pub async fn next(&mut self) -> Option<Event> {
        if self.left == 0 {
            return None;
        }
        let event = self.rx.recv().await?;
        if let Event::Done(..) = event {
            self.left -= 1;
        }
        Some(event)
    }

    /// Every request's output, in submission order (the first failure instead, if any).
    pub async fn outputs(mut self) -> crate::Result<Vec<RequestOutput>> {
        let mut outs: Vec<Option<RequestOutput>> = (0..self.tickets.len()).map(|_| None).collect();
        while let Some(event) = self.next().await {
            if let Event::Done(i, out) = event {
                outs[i] = Some(out?);
            }
        }
        outs.into_iter().map(|o| o.ok_or_else(|| crate::Error::Other("the engine dropped a request".into()))).collect()
    }
}

impl Drop for Jobs {
    fn drop(&mut self) {
        if self.left > 0 {
            for &t in &self.tickets {
                drop(self.server.engine.cancel(t)); // a no-op for those that ended
            }
        }
    }
}
