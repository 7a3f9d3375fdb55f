//! The NBD export: every mapped device is an export named after it.

pub mod conn;
pub mod handshake;
pub mod placement;
pub mod proto;
pub mod reactor;
pub mod tls;

use crate::mapper::Registry;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

static HANDSHAKE_TIMEOUT_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(30_000);

/// Set how long a client has to finish the handshake (`serve
/// --nbd-handshake-timeout-ms`; 30 s unless set).
pub fn set_handshake_timeout(t: Duration) {
    HANDSHAKE_TIMEOUT_MS.store(t.as_millis().max(1) as u64, Ordering::Relaxed);
}

/// How long a client has to finish the handshake.
fn handshake_timeout() -> Duration {
    Duration::from_millis(HANDSHAKE_TIMEOUT_MS.load(Ordering::Relaxed))
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

/// Take one client through its handshake on this thread: the connection, ready
/// for its transmission phase (None: it ended, and why is logged).
fn negotiate<S: Read + Write + AsRawFd + AsFd + Into<OwnedFd>>(
    mut s: S,
    reg: &Registry,
    peer: &str,
    tls: &tls::Tls,
) -> Option<conn::NewConn> {
    let (neg, session) = match handshake(&mut s, reg, tls) {
        Ok(Some(n)) => n,
        Ok(None) => return None,
        Err(e) => {
            crate::lograte::client_line(tracing::Level::INFO, &format!("nbd {peer}: handshake ended: {e}"));
            return None;
        }
    };
    neg.dev.open_count.fetch_add(1, Ordering::SeqCst);
    let sock: OwnedFd = s.into();
    Some(conn::NewConn {
        track: placement::Track::new(sock.as_fd()),
        sock,
        neg,
        session,
        moved: false,
    })
}

/// Take one client through its handshake, then hand it to a reactor.
pub fn serve_connection<S: Read + Write + AsRawFd + AsFd + Into<OwnedFd>>(
    s: S,
    reg: &Registry,
    peer: &str,
    tls: &tls::Tls,
    reactors: &reactor::Reactors,
) {
    // one bound on the whole handshake (an attached client may then idle)
    let Some(deadline) = reactors.deadline(&s, handshake_timeout()) else {
        tracing::warn!("nbd {peer}: no descriptor to bound the handshake with; the client is turned away");
        return;
    };
    let c = negotiate(s, reg, peer, tls);
    drop(deadline);
    if let Some(c) = c {
        reactors.hand(c);
    }
}

/// The whole life of one connection on this thread: its handshake, then its
/// transmission phase on an engine of its own (the fuzzers' way in).
pub fn serve_one<S: Read + Write + AsRawFd + AsFd + Into<OwnedFd>>(
    s: S,
    reg: &Arc<Registry>,
    peer: &str,
    tls: &tls::Tls,
) {
    if let Some(c) = negotiate(s, reg, peer, tls) {
        let dev = c.neg.dev.clone();
        if let Err(e) = reactor::serve_alone(c, reg) {
            crate::lograte::client_line(
                tracing::Level::WARN,
                &format!("nbd {peer}: cannot serve the connection: {e}"),
            );
            dev.open_count.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Accept clients for ever: each one's handshake on a thread of its own (at most
/// [`reactor::MAX_HANDSHAKES`] at once; the others wait in the listen queue),
/// then on a reactor.
fn accept<S>(
    mut next: impl FnMut() -> Option<(S, String)>,
    reg: Arc<Registry>,
    tls: Arc<tls::Tls>,
    reactors: Arc<reactor::Reactors>,
) where
    S: Read + Write + AsRawFd + AsFd + Into<OwnedFd> + Send + 'static,
{
    loop {
        reactors.wait_for_room();
        let Some((s, peer)) = next() else {
            // out of descriptors or memory: let the clients already in go first
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        reactors.begin_handshake(&reg);
        let (reg2, tls2, r2) = (reg.clone(), tls.clone(), reactors.clone());
        let spawned = std::thread::Builder::new()
            .name("nbd-handshake".into())
            .spawn(move || {
                serve_connection::<S>(s, &reg2, &peer, &tls2, &r2);
                r2.end_handshake(&reg2);
            });
        if let Err(e) = spawned {
            tracing::warn!("nbd: no thread for a handshake ({e}); the client is turned away");
            reactors.end_handshake(&reg);
        }
    }
}

pub fn serve_unix(
    listener: UnixListener,
    reg: Arc<Registry>,
    tls: Arc<tls::Tls>,
    reactors: Arc<reactor::Reactors>,
) {
    let next = || {
        let (s, _) = listener.accept().ok()?;
        Some((s, "unix".to_string()))
    };
    accept::<UnixStream>(next, reg, tls, reactors);
}

pub fn serve_tcp(
    listener: TcpListener,
    reg: Arc<Registry>,
    tls: Arc<tls::Tls>,
    reactors: Arc<reactor::Reactors>,
) {
    let next = || {
        let (s, addr) = listener.accept().ok()?;
        let _ = s.set_nodelay(true);
        Some((s, addr.to_string()))
    };
    accept::<TcpStream>(next, reg, tls, reactors);
}
