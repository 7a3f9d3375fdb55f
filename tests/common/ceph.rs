//! A throw-away single-node Ceph cluster for the RBD tests (`ci/ceph-cluster.sh`:
//! one monitor and one OSD on 127.0.0.1, no manager, no authentication, pool
//! `rbd`), one for the whole run: the test processes (nextest runs each test in
//! a process of its own, `cargo test` a binary's tests in one) are children of
//! one runner, so the first test that asks starts the cluster under a lock, keyed
//! by that parent, the others find it running, and the script's own watch stops
//! it when the parent exits. A cluster that cannot start fails the test that
//! asked for it.

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
    // the runner; a test process with no parent of its own (pid 1's child in a
    // container, or an orphan) keys and stops the cluster by itself
    let parent = match std::os::unix::process::parent_id() {
        0 | 1 => std::process::id(),
        p => p,
    };
    // Short: admin sockets need a path under 108 bytes.
    let dir = PathBuf::from(format!("/tmp/dmkit-ceph-{parent}"));
    let lock = std::fs::File::create(format!("/tmp/dmkit-ceph-{parent}.lock"))
        .map_err(|e| format!("the cluster's lock file: {e}"))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| format!("the cluster's lock: {e}"))?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/ceph-cluster.sh");
    let run = |args: &[&str]| {
        Command::new("timeout")
            .arg("300")
            .arg("bash")
            .arg(&script)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run {}: {e}", script.display()))
    };
    let d = dir.to_string_lossy().into_owned();
    let up = run(&["up", &d])?;
    let o = if up.status.success() {
        up
    } else {
        // a directory a dead cluster left (an earlier runner of the same pid)
        // goes first
        run(&["stop", &d])?;
        run(&["start", &d, "--parent", &parent.to_string()])?
    };
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    let conf = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    eprintln!("ceph fixture: ready in {:?} ({})", t0.elapsed(), conf.display());
    Ok(Cluster { dir, conf })
}
