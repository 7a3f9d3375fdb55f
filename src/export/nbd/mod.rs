//! The NBD export: every mapped device is an export named after it.

pub mod conn;
pub mod handshake;
pub mod proto;

use crate::mapper::Registry;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A client has this long to finish the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serve one client connection to the end.
pub fn serve_connection<S: Read + Write + AsRawFd>(mut s: S, reg: &Registry, peer: &str) {
    let neg = match handshake::negotiate(&mut s, reg) {
        Ok(Some(n)) => n,
        Ok(None) => return,
        Err(e) => {
            crate::log::info(&format!("nbd {peer}: handshake ended: {e}"));
            return;
        }
    };
    let dev = neg.dev.clone();
    dev.open_count.fetch_add(1, Ordering::SeqCst);
    let mut conn = conn::Conn::new(s.as_raw_fd(), neg);
    conn.run();
    dev.open_count.fetch_sub(1, Ordering::SeqCst);
    drop(conn);
    drop(s);
}

pub fn serve_unix(listener: UnixListener, reg: Arc<Registry>) {
    for s in listener.incoming() {
        let Ok(s) = s else { continue };
        let reg = reg.clone();
        let _ = s.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let _ = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                let s = prepare_unix(s);
                serve_connection(s, &reg, "unix");
            });
    }
}

fn prepare_unix(s: UnixStream) -> UnixStream {
    s
}

pub fn serve_tcp(listener: TcpListener, reg: Arc<Registry>) {
    for s in listener.incoming() {
        let Ok(s) = s else { continue };
        let reg = reg.clone();
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let _ = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                serve_connection::<TcpStream>(s, &reg, &peer);
            });
    }
}
