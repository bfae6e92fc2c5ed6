//! The accept loop: every connection goes through the [`Gate`] (per-peer cap, connection cap,
//! health-only overflow), then is served as HTTP/1.1 by hyper with a deadline on its headers
//! (`--header-timeout-s`, separate from the idle timeout: a client that trickles its headers a
//! byte at a time is closed after it, while a long poll or a slow upload keeps its connection).
//! The header deadline also closes a keep-alive connection left idle that long; clients reopen
//! them (the SDK's own keep-alive expiry is shorter).
//!
//! Own loop rather than `axum::serve` because that one sets no header deadline and takes every
//! connection alike.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use super::connections::{Admission, Connection, Gate};
use super::{routes, AppState};

/// Serves `listener` until `stop` completes, then stops accepting and waits for the open
/// connections' requests to finish (idle ones are closed).
pub async fn serve_until(
    listener: TcpListener,
    state: Arc<AppState>,
    stop: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let l = &state.limits;
    let gate = Gate::new(l.max_connections, l.max_connections_per_peer);
    let idle = Duration::from_secs(l.idle_timeout_s);
    let header_timeout = Duration::from_secs(l.header_timeout_s.max(1));
    let full = routes::router(state.clone());
    let health_only = routes::health_only_router(state.clone());
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of descriptors or a connection reset before it was taken: try again soon.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let (place, router, keep_alive) = match gate.admit(peer.ip()) {
            Admission::Full(p) => (p, full.clone(), true),
            Admission::HealthOnly(p) => (p, health_only.clone(), false),
            Admission::Refused(answer) => {
                // A fresh socket's send buffer takes these few bytes at once; closing follows.
                let _ = stream.try_write(answer);
                continue;
            }
        };
        let io = TokioIo::new(Connection::new(stream, place, idle));
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .keep_alive(keep_alive)
            .serve_connection(io, TowerToHyperService::new(router));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A connection's errors (timeouts, resets, malformed heads) end it; nothing to report.
            let _ = conn.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// [`serve_until`] with no stop: serves until the runtime ends.
pub async fn serve(listener: TcpListener, state: Arc<AppState>) -> std::io::Result<()> {
    serve_until(listener, state, std::future::pending()).await
}
