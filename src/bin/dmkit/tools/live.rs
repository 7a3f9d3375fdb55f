//! The tools on a live pool: `/dev/mapper/NAME` names a pool the dmkit daemon
//! serves, which answers thin_ls and thin_delta as pool messages.

use super::{emit, Failure, Outcome};
use dmkit::thin::online::Request;
use std::path::Path;

/// `/dev/mapper/NAME` when no such file exists: the pool NAME in the daemon.
pub(super) fn live_pool(input: &Path) -> Option<String> {
    let name = input.strip_prefix("/dev/mapper/").ok()?.to_str()?;
    (!input.exists() && !name.is_empty() && !name.contains('/')).then(|| name.to_string())
}

/// Run a tool on a live pool: a message to the pool through the daemon, which
/// commits, holds the metadata still and answers from the committed trees.
pub(super) fn ask_daemon(pool: String, request: &Request) -> Outcome {
    let sock = dmkit::client::default_run_dir().join("control.sock");
    let mut s = std::os::unix::net::UnixStream::connect(&sock).map_err(|e| {
        Failure::Message(format!(
            "cannot reach the dmkit daemon at {} for pool {pool}: {e}",
            sock.display()
        ))
    })?;
    let mut words = vec!["message".to_string(), pool.clone(), "0".to_string()];
    words.extend(request.words());
    let (ok, out, err) = dmkit::client::call(&mut s, &words, b"")
        .map_err(|e| Failure::Message(format!("talking to the daemon: {e}")))?;
    if !ok {
        if let Some(DaemonDev::Other(why)) = daemon_device(&pool) {
            return Err(Failure::Message(why));
        }
        // the pool's own words, without the registry's "NAME: message '...' refused: "
        let e = err.trim_end();
        let e = e.rsplit_once(" refused: ").map_or(e, |x| x.1);
        return Err(Failure::Message(e.to_string()));
    }
    // the tool's text, and the one newline `online` added to it
    emit(out.strip_suffix('\n').unwrap_or(&out))
}

/// What the daemon serves as `/dev/mapper/NAME`, for a tool's error.
enum DaemonDev {
    /// A thin pool, with its metadata file.
    Pool(String),
    /// Not a thin pool: the error to give.
    Other(String),
}

/// Ask the daemon (if one answers) what device NAME is.
fn daemon_device(name: &str) -> Option<DaemonDev> {
    let sock = dmkit::client::default_run_dir().join("control.sock");
    let mut s = std::os::unix::net::UnixStream::connect(sock).ok()?;
    let words = ["table".to_string(), name.to_string()];
    let (ok, out, _) = dmkit::client::call(&mut s, &words, b"").ok()?;
    if !ok {
        return None;
    }
    let first: Vec<&str> = out.lines().next().unwrap_or("").split(' ').collect();
    Some(match first.get(2) {
        Some(&"thin-pool") => DaemonDev::Pool(first.get(3).unwrap_or(&"?").to_string()),
        Some(t) => DaemonDev::Other(format!("dev {name} is a {t} device, not a thin-pool")),
        None => DaemonDev::Other(format!("dev {name} has no table, so it is not a thin-pool")),
    })
}

/// Why `/dev/mapper/NAME` is no input file, when the daemon serves NAME.
pub(super) fn mapper_hint(input: &Path) -> Option<String> {
    let name = live_pool(input)?;
    Some(match daemon_device(&name)? {
        DaemonDev::Other(why) => why,
        DaemonDev::Pool(meta) => format!(
            "{} is dmkit's pool {name}, not a kernel device: its metadata is {meta}, which the tools \
             read once the pool is removed (thin ls and thin delta also read the live pool)",
            input.display()
        ),
    })
}
