//! A throw-away single-node Ceph cluster for the RBD tests (`ci/ceph-cluster.sh`:
//! one monitor and one OSD on 127.0.0.1, no manager, no authentication, pool
//! `rbd`), started once per test binary by the first test that asks and stopped
//! when the binary exits (or, if it is killed, by the script's own watch on it).
//! A cluster that cannot start fails the test that asked for it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

pub struct Cluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

/// The cluster, started on first use.
pub fn cluster() -> &'static Cluster {
    match CLUSTER.get_or_init(start) {
        Ok(c) => c,
        Err(e) => panic!("the test Ceph cluster did not start (ci/install.sh installs Ceph): {e}"),
    }
}

impl Cluster {
    /// `rbd -c CONF args...`; panics with its output on failure.
    pub fn rbd(&self, args: &[&str]) -> String {
        let o = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .output()
            .expect("run rbd");
        assert!(
            o.status.success(),
            "rbd {args:?} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// A new image of `bytes` (features as `rbd create` gives them: with the
    /// exclusive lock).
    pub fn create_image(&self, name: &str, bytes: u64) {
        // a leftover of an earlier run in this cluster goes first
        let _ = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(["rm", "--no-progress", &format!("rbd/{name}")])
            .output();
        self.rbd(&[
            "create",
            "--size",
            &format!("{}K", bytes / 1024),
            &format!("rbd/{name}"),
        ]);
    }

    /// The table name of image `name`.
    pub fn dev(&self, name: &str) -> String {
        format!("rbd:rbd/{name}:conf={}", self.conf.display())
    }

    /// Everything in image `name` (`rbd export`).
    pub fn export(&self, name: &str, into: &Path) -> Vec<u8> {
        let _ = std::fs::remove_file(into);
        self.rbd(&[
            "export",
            "--no-progress",
            &format!("rbd/{name}"),
            &into.to_string_lossy(),
        ]);
        std::fs::read(into).expect("read export")
    }
}

fn start() -> Result<Cluster, String> {
    let t0 = Instant::now();
    // Short: admin sockets need a path under 108 bytes.
    let dir = PathBuf::from(format!("/tmp/dmkit-ceph-{}", std::process::id()));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/ceph-cluster.sh");
    let o = Command::new("timeout")
        .arg("300")
        .arg("bash")
        .arg(&script)
        .arg("start")
        .arg(&dir)
        .arg("--parent")
        .arg(std::process::id().to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run {}: {e}", script.display()))?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    let conf = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    // SAFETY: registers a plain function with no captured state.
    unsafe { libc::atexit(stop_at_exit) };
    eprintln!("ceph fixture: ready in {:?} ({})", t0.elapsed(), conf.display());
    Ok(Cluster { dir, conf })
}

extern "C" fn stop_at_exit() {
    if let Some(Ok(c)) = CLUSTER.get() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/ceph-cluster.sh");
        let _ = Command::new("bash").arg(script).arg("stop").arg(&c.dir).status();
    }
}
