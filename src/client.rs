//! The client end of the control socket: where a daemon listens and how to send
//! it one request. Tools and the I/O layer (asking who holds a file) use it
//! without the daemon or the verbs behind it; it names nothing else of the crate.
//!
//! Framing (both directions): a length (u32 BE) then the bytes. A request is
//! argc (u32 BE), the arguments, then standard input; a reply is a status byte
//! (0 ok), stdout text and stderr text.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// The run directory: `$DMKIT_RUN_DIR`, else /run/dmkit for root and
/// `$XDG_RUNTIME_DIR/dmkit` otherwise.
pub fn default_run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("DMKIT_RUN_DIR") {
        return PathBuf::from(d);
    }
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/dmkit");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(x) => Path::new(&x).join("dmkit"),
        None => std::env::temp_dir().join(format!("dmkit-{}", uid.as_raw())),
    }
}

/// Append `b` to `w` as one length-prefixed field.
pub(crate) fn put(w: &mut Vec<u8>, b: &[u8]) {
    w.extend_from_slice(&(b.len() as u32).to_be_bytes());
    w.extend_from_slice(b);
}

/// Read one length-prefixed field, refusing it if longer than what is left of
/// `budget` (which it then shrinks).
pub(crate) fn get<R: Read>(r: &mut R, budget: &mut u32) -> io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    r.read_exact(&mut l)?;
    let n = u32::from_be_bytes(l);
    if n > *budget {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control request too large",
        ));
    }
    *budget -= n;
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Send `args` (+ stdin) and return (ok, stdout, stderr).
pub fn call<S: Read + Write>(s: &mut S, args: &[String], stdin: &[u8]) -> io::Result<(bool, String, String)> {
    let mut req = Vec::new();
    req.extend_from_slice(&(args.len() as u32).to_be_bytes());
    for a in args {
        put(&mut req, a.as_bytes());
    }
    put(&mut req, stdin);
    s.write_all(&req)?;
    let mut st = [0u8; 1];
    s.read_exact(&mut st)?;
    let mut budget = u32::MAX;
    let out = get(s, &mut budget)?;
    let err = get(s, &mut budget)?;
    Ok((
        st[0] == 0,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    ))
}
