//! The library `dmkit exec` preloads into a program so that its
//! `/dev/mapper/control` reaches the daemon's dm ioctl door
//! ([`crate::control::door`]).
//!
//! It is C (src/control/preload.c, built by build.rs with the `cc` crate's
//! compiler), not a Rust cdylib: libc's `open`, `openat` and `ioctl` are
//! variadic, and stable Rust cannot define a variadic function; fixed-arity
//! definitions would work only by the accident of the x86-64 calling
//! convention. LD_PRELOAD rather than a seccomp supervisor: the programs that
//! use device-mapper (dmsetup, lvm, cryptsetup) reach it through libdevmapper,
//! dynamically linked, and a preload answers in the caller's own process with no
//! supervisor to keep alive; a static binary is not covered (said in docs/manual/door.md).
//!
//! The library is carried in the dmkit binary and written into the run
//! directory when `exec` needs it, so a fresh machine needs nothing installed.

use std::path::{Path, PathBuf};

/// The shared object's bytes.
pub const LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libdmkit-door.so"));

/// The library's file name in the run directory.
pub const FILE: &str = "libdmkit-door.so";

/// Write the library where this user can: into `run_dir`, or, where the run
/// directory is not this user's to write (a daemon of root's shared with a
/// group), into a directory of this user's own under the temporary directory.
/// Returns the library's path; its directory also holds the device nodes
/// libdevmapper makes (`dev/`).
pub fn install_for_user(run_dir: &Path) -> std::io::Result<PathBuf> {
    match install(run_dir) {
        Ok(p) => Ok(p),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => install(&private_dir()?),
        Err(e) => Err(e),
    }
}

/// `TMPDIR/dmkit-door-UID`, made mode 0700; refused if another user owns it or
/// others may write to it (a library there is run by this user's programs).
fn private_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let uid = rustix::process::getuid().as_raw();
    let dir = std::env::temp_dir().join(format!("dmkit-door-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = std::fs::symlink_metadata(&dir)?;
    if !m.is_dir() || m.uid() != uid || m.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a directory of this user's that only it may write",
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

/// Write the library into `run_dir` (unless the same bytes are there), by a
/// new file renamed into place, so a program starting meanwhile never maps a
/// half-written one. Returns its path.
pub fn install(run_dir: &Path) -> std::io::Result<PathBuf> {
    let path = run_dir.join(FILE);
    if std::fs::read(&path).is_ok_and(|b| b == LIBRARY) {
        return Ok(path);
    }
    std::fs::create_dir_all(run_dir)?;
    let tmp = run_dir.join(format!("{FILE}.{}", std::process::id()));
    std::fs::write(&tmp, LIBRARY)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}
