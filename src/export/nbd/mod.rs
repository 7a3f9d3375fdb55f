//! The NBD export: every mapped device is an export named after it.

pub mod conn;
pub mod handshake;
pub mod proto;
pub mod tls;

use crate::mapper::Registry;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How long a client has to finish the handshake: 30 s, or
/// `DMKIT_HANDSHAKE_TIMEOUT_MS` (tests shorten it).
fn handshake_timeout() -> Duration {
    let ms = std::env::var("DMKIT_HANDSHAKE_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok());
    Duration::from_millis(ms.unwrap_or(30_000))
}

/// The handshake, with STARTTLS where `tls` offers it: what it settled and the
/// TLS session it runs in, if any. Ok(None) when the client aborted or left.
fn handshake<S: Read + Write + AsFd>(
    s: &mut S,
    reg: &Registry,
    tls: &tls::Tls,
) -> std::io::Result<Option<(handshake::Negotiated, Option<tls::Session>)>> {
    use handshake::{Outcome, TlsState};
    let g = handshake::greet(s)?;
    let state = match tls.mode {
        tls::Mode::Off => TlsState::Off,
        tls::Mode::On => TlsState::Offered,
        tls::Mode::Require => TlsState::Required,
    };
    let plain = |name: &str| tls.visible(None, name);
    match handshake::options(s, reg, g, state, &plain)? {
        Outcome::Go(n) => Ok(Some((n, None))),
        Outcome::Closed => Ok(None),
        Outcome::StartTls => {
            let mut session = tls.accept(&*s)?;
            let peer = tls.peer(&session);
            tracing::debug!(
                "nbd: TLS client {} ({})",
                peer.as_deref().unwrap_or("without an identity"),
                session.version()
            );
            let visible = |name: &str| tls.visible(peer.as_deref(), name);
            match handshake::options(&mut session, reg, g, TlsState::Active, &visible)? {
                Outcome::Go(n) => {
                    session.to_transmission();
                    Ok(Some((n, Some(session))))
                }
                Outcome::Closed | Outcome::StartTls => Ok(None),
            }
        }
    }
}

/// Serve one client connection to the end.
pub fn serve_connection<S: Read + Write + AsRawFd + AsFd>(
    mut s: S,
    reg: &Registry,
    peer: &str,
    tls: &tls::Tls,
) {
    let (neg, session) = match handshake(&mut s, reg, tls) {
        Ok(Some(n)) => n,
        Ok(None) => return,
        Err(e) => {
            tracing::info!("nbd {peer}: handshake ended: {e}");
            return;
        }
    };
    // The handshake deadline does not apply to an attached client, which may idle.
    clear_receive_timeout(&s);
    let dev = neg.dev.clone();
    dev.open_count.fetch_add(1, Ordering::SeqCst);
    match conn::Conn::new(s.as_raw_fd(), neg, session) {
        Ok(mut conn) => conn.run(),
        Err(e) => tracing::warn!("nbd {peer}: cannot serve the connection: {e}"),
    }
    drop(s);
    dev.open_count.fetch_sub(1, Ordering::SeqCst);
    reg.closed(&dev);
}

pub fn serve_unix(listener: UnixListener, reg: Arc<Registry>, tls: Arc<tls::Tls>) {
    for s in listener.incoming() {
        let Ok(s) = s else { continue };
        let reg = reg.clone();
        let tls = tls.clone();
        let _ = s.set_read_timeout(Some(handshake_timeout()));
        let _ = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || serve_connection::<UnixStream>(s, &reg, "unix", &tls));
    }
}

fn clear_receive_timeout(s: impl AsFd) {
    let _ = rustix::net::sockopt::set_socket_timeout(s, rustix::net::sockopt::Timeout::Recv, None);
}

pub fn serve_tcp(listener: TcpListener, reg: Arc<Registry>, tls: Arc<tls::Tls>) {
    for s in listener.incoming() {
        let Ok(s) = s else { continue };
        let reg = reg.clone();
        let tls = tls.clone();
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(handshake_timeout()));
        let _ = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                serve_connection::<TcpStream>(s, &reg, &peer, &tls);
            });
    }
}
