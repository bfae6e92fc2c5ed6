//! Which connections the server takes, and how long a silent one may hold its place.
//!
//! [`Gate`] decides at accept time, never by leaving a connection in the kernel's backlog (a
//! backlog full of one client's connections would shut everyone else out):
//! - a peer address with `max_connections_per_peer` open already gets a canned `429` and is
//!   closed, so that one client (or one host reopening them as they close) cannot take the
//!   server's slots;
//! - otherwise, while fewer than `max_connections` are open, a full connection;
//! - otherwise one of [`HEALTH_ONLY_CONNECTIONS`] connections that answers `healthz` and
//!   `readyz` only (everything else a `503` with `Retry-After`), so health checks get their
//!   answer while the cap is reached;
//! - otherwise a canned `503`.
//!
//! [`Connection`] wraps an admitted stream: it holds its place until dropped, and a read that
//! gets no byte for `idle` fails (a body that stalls midway). Headers have their own, shorter
//! deadline in the HTTP layer (`--header-timeout-s`, see [`super::http`]).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::locks::lock;

/// Connections kept beyond `max_connections` for health and readiness checks alone.
pub const HEALTH_ONLY_CONNECTIONS: usize = 64;

#[derive(Default)]
struct Counts {
    /// Full connections open.
    full: usize,
    /// Health-only connections open.
    health_only: usize,
    /// Open connections (both kinds) per peer address.
    peers: HashMap<IpAddr, usize>,
}

pub struct Gate {
    max_connections: usize,
    max_per_peer: usize,
    counts: Mutex<Counts>,
}

/// What an accepted connection may do.
pub enum Admission {
    /// Every endpoint.
    Full(Place),
    /// `healthz` and `readyz` only: the connection cap is reached.
    HealthOnly(Place),
    /// Nothing: the canned answer to write before closing it.
    Refused(&'static [u8]),
}

/// A connection's place in the [`Gate`]'s counts, given back when dropped.
pub struct Place {
    gate: Arc<Gate>,
    peer: IpAddr,
    health_only: bool,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut c = lock(&self.gate.counts);
        if self.health_only {
            c.health_only -= 1;
        } else {
            c.full -= 1;
        }
        if let Some(n) = c.peers.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.peers.remove(&self.peer);
            }
        }
    }
}

/// The answer to a peer over its cap (a whole response: it is written before any request is
/// read, then the connection is closed).
const TOO_MANY_FROM_PEER: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\nconnection: close\r\nretry-after: 1\r\n\
content-type: application/json\r\ncontent-length: 135\r\n\r\n\
{\"error\":\"too many connections from this address (oxrl serve --max-connections-per-peer): close idle ones and retry\",\"category\":\"user\"}";

/// The answer when every slot, health-only ones included, is taken.
const SERVER_FULL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\nretry-after: 1\r\n\
content-type: application/json\r\ncontent-length: 110\r\n\r\n\
{\"error\":\"the server's connection limit is reached (oxrl serve --max-connections): retry\",\"category\":\"server\"}";

impl Gate {
    pub fn new(max_connections: usize, max_per_peer: usize) -> Arc<Gate> {
        Arc::new(Gate {
            max_connections: max_connections.max(1),
            max_per_peer: max_per_peer.max(1),
            counts: Mutex::default(),
        })
    }

    /// Admits a connection from `peer` (see the module's docs for the order of the checks).
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Admission {
        // An IPv4 client of a dual-stack listener counts as its IPv4 address.
        let peer = peer.to_canonical();
        let mut c = lock(&self.counts);
        let from_peer = c.peers.get(&peer).copied().unwrap_or(0);
        if from_peer >= self.max_per_peer {
            return Admission::Refused(TOO_MANY_FROM_PEER);
        }
        let health_only = if c.full < self.max_connections {
            c.full += 1;
            false
        } else if c.health_only < HEALTH_ONLY_CONNECTIONS {
            c.health_only += 1;
            true
        } else {
            return Admission::Refused(SERVER_FULL);
        };
        *c.peers.entry(peer).or_default() += 1;
        let place = Place { gate: self.clone(), peer, health_only };
        if health_only {
            Admission::HealthOnly(place)
        } else {
            Admission::Full(place)
        }
    }

    /// (full, health-only) connections open now.
    pub fn open(&self) -> (usize, usize) {
        let c = lock(&self.counts);
        (c.full, c.health_only)
    }
}

/// An admitted connection holding its place; reads time out after `idle` without a byte.
pub struct Connection {
    stream: TcpStream,
    _place: Place,
    idle: Duration,
    /// Armed while a read waits for bytes.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl Connection {
    pub fn new(stream: TcpStream, place: Place, idle: Duration) -> Self {
        let _ = stream.set_nodelay(true);
        Connection { stream, _place: place, idle, waiting: None }
    }
}

impl AsyncRead for Connection {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Pending => {
                let idle = this.idle;
                let timer = this.waiting.get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "idle connection"))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                this.waiting = None;
                ready
            }
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(a: Admission) -> Option<(bool, Place)> {
        match a {
            Admission::Full(p) => Some((false, p)),
            Admission::HealthOnly(p) => Some((true, p)),
            Admission::Refused(_) => None,
        }
    }

    #[test]
    fn canned_answers_have_their_declared_lengths() {
        for answer in [TOO_MANY_FROM_PEER, SERVER_FULL] {
            let text = std::str::from_utf8(answer).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").unwrap();
            let declared: usize = head.split("content-length: ").nth(1).unwrap().parse().unwrap();
            assert_eq!(declared, body.len(), "{head}");
            serde_json::from_str::<serde_json::Value>(body).unwrap();
        }
    }

    #[test]
    fn a_peer_over_its_cap_is_refused_and_the_cap_leaves_health_checks_room() {
        let gate = Gate::new(3, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = place(gate.admit(a)).unwrap();
        let a2 = place(gate.admit(a)).unwrap();
        assert!(!a1.0 && !a2.0);
        assert!(matches!(gate.admit(a), Admission::Refused(r) if r == TOO_MANY_FROM_PEER));
        // The same peer over IPv4-mapped IPv6 is the same peer.
        assert!(matches!(gate.admit("::ffff:10.0.0.1".parse().unwrap()), Admission::Refused(_)));
        let b1 = place(gate.admit(b)).unwrap();
        assert!(!b1.0);
        // Cap of 3 reached: b's next is health-only.
        let b2 = place(gate.admit(b)).unwrap();
        assert!(b2.0);
        assert_eq!(gate.open(), (3, 1));
        drop(a1);
        assert_eq!(gate.open(), (2, 1));
        let c = place(gate.admit("10.0.0.3".parse().unwrap())).unwrap();
        assert!(!c.0, "a freed full slot is taken again");
        drop((a2, b1, b2, c));
        assert_eq!(gate.open(), (0, 0));
        assert!(lock(&gate.counts).peers.is_empty());
    }

    #[test]
    fn past_the_health_only_connections_the_server_is_full() {
        let gate = Gate::new(1, usize::MAX);
        let held: Vec<_> = (0..=HEALTH_ONLY_CONNECTIONS)
            .map(|i| place(gate.admit(IpAddr::from([10, 0, (i / 256) as u8, (i % 256) as u8]))).unwrap())
            .collect();
        assert!(matches!(gate.admit("10.9.9.9".parse().unwrap()), Admission::Refused(r) if r == SERVER_FULL));
        drop(held);
    }
}
