//! Shared test harness: a real daemon in a scratch directory, the real CLI, real
//! client tools, and a minimal raw NBD client for protocol-level checks.
#![allow(dead_code)]

pub mod ceph;
pub mod fs;
pub mod nbd;
pub mod placement;
pub mod verity;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_dmkit");
/// A mebibyte, for sizes.
pub const MIB: u64 = 1 << 20;

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let base = std::env::var_os("DMKIT_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let p = base.join(format!(
            "dmkit-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create scratch dir");
        Scratch(p)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    /// A sparse file of `bytes`.
    pub fn sparse(&self, name: &str, bytes: u64) -> PathBuf {
        let p = self.path(name);
        let f = std::fs::File::create(&p).expect("create file");
        f.set_len(bytes).expect("set_len");
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // DMKIT_KEEP=1 keeps scratch directories (and daemon logs) for a look
        if std::env::var_os("DMKIT_KEEP").is_some() {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `dmkit serve`, stopped (SIGTERM) on drop.
pub struct Daemon {
    pub dir: Scratch,
    pub run: PathBuf,
    child: Child,
}

impl Daemon {
    pub fn start(tag: &str) -> Daemon {
        Self::start_with(tag, &[], &[])
    }

    pub fn start_with(tag: &str, args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::start_wrapped(tag, &[], args, env)
    }

    /// Start the daemon under `wrapper` (a command that runs the rest of its
    /// arguments, such as `unshare -m sh -c '...; exec "$0" "$@"'`).
    pub fn start_wrapped(tag: &str, wrapper: &[&str], args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::spawn(Scratch::new(tag), wrapper, args, env)
    }

    /// SIGKILL the daemon and start `dmkit serve --restore` in the same run
    /// directory (its log goes on in the same file).
    pub fn kill9_and_restore(mut self) -> Daemon {
        self.kill9();
        let dir = std::mem::replace(&mut self.dir, Scratch(PathBuf::new()));
        // the dead daemon's sockets: the new one binds them before it restores
        for s in ["control.sock", "nbd.sock", "dm-ioctl.sock", "serve.pid"] {
            let _ = std::fs::remove_file(self.run.join(s));
        }
        drop(self);
        Self::spawn(dir, &[], &["--restore"], &[])
    }

    fn spawn(dir: Scratch, wrapper: &[&str], args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let run = dir.path("run");
        let mut cmd = match wrapper.split_first() {
            Some((w, rest)) => {
                let mut c = Command::new(w);
                c.args(rest).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        cmd.arg("serve").arg("--run-dir").arg(&run).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(dir.path("daemon.log"))
                    .expect("log"),
            ))
            .spawn()
            .expect("spawn dmkit serve");
        let d = Daemon { dir, run, child };
        let t0 = Instant::now();
        // serve.pid is written once the daemon answers (after a --restore's
        // replay): the sockets exist before that
        while !(d.run.join("control.sock").exists()
            && d.run.join("nbd.sock").exists()
            && d.run.join("serve.pid").exists())
        {
            assert!(t0.elapsed() < Duration::from_secs(10), "daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn sock(&self) -> PathBuf {
        self.run.join("nbd.sock")
    }

    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.sock().display())
    }

    /// Run `dmkit --run-dir RUN args...`, with `stdin` fed in.
    pub fn cli_in(&self, args: &[&str], stdin: &str) -> Output {
        let mut c = Command::new(BIN)
            .arg("--run-dir")
            .arg(&self.run)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dmkit");
        {
            use std::io::Write;
            let mut i = c.stdin.take().expect("stdin");
            let _ = i.write_all(stdin.as_bytes());
        }
        c.wait_with_output().expect("dmkit output")
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_in(args, "")
    }

    /// `dmkit --run-dir RUN exec --`, in the C locale: append the program and
    /// its arguments (the dm ioctl door open to this daemon).
    pub fn exec(&self) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--run-dir")
            .arg(&self.run)
            .args(["exec", "--"])
            .env("LC_ALL", "C");
        c
    }

    /// Run `PROGRAM ARGS...` behind the door, requiring success and nothing
    /// on stderr; returns stdout.
    pub fn door_ok(&self, program: &str, args: &[&str]) -> String {
        let o = self.exec().arg(program).args(args).output().expect("dmkit exec");
        assert!(
            o.status.success() && o.stderr.is_empty(),
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `cryptsetup luksFormat` behind the door: a LUKS2 volume on `img`
    /// with `--integrity hmac-sha256` and `cipher`, keyed by the passphrase
    /// in `key_file` (a fast PBKDF, the key in the table).
    pub fn luks_format_integrity(&self, img: &str, cipher: &str, key_file: &str) {
        self.door_ok(
            "cryptsetup",
            &[
                "luksFormat",
                "--batch-mode",
                "--type",
                "luks2",
                "--integrity",
                "hmac-sha256",
                "--cipher",
                cipher,
            ]
            .into_iter()
            .chain(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
            .chain(["--disable-keyring", "--key-file", key_file, img])
            .collect::<Vec<_>>(),
        );
    }

    /// A direct read of block `skip` (of `bs` bytes) of `/dev/mapper/NAME`
    /// by dd behind the door fails with EILSEQ, as a checksum failure does.
    pub fn read_fails_with_eilseq(&self, name: &str, bs: u64, skip: u64) {
        let o = self
            .exec()
            .args([
                "dd",
                &format!("if=/dev/mapper/{name}"),
                "of=/dev/null",
                &format!("bs={bs}"),
            ])
            .args([format!("skip={skip}"), "count=1".into(), "iflag=direct".into()])
            .output()
            .expect("dd");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success());
        assert!(
            e.contains("Invalid or incomplete multibyte or wide character"),
            "dd behind the door sees EILSEQ: {e}"
        );
    }

    /// The length in sectors of `name`'s table (its one line's).
    pub fn sectors(&self, name: &str) -> u64 {
        self.ok(&["table", name])
            .split(' ')
            .nth(1)
            .and_then(|v| v.parse().ok())
            .expect("the table's length")
    }

    /// Run and require success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(
            o.status.success(),
            "dmkit {args:?} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The line of `info NAME` that starts with `key`.
    pub fn info_line(&self, name: &str, key: &str) -> String {
        let out = self.ok(&["info", name]);
        out.lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("no '{key}' in info:\n{out}"))
            .to_string()
    }

    /// Wait (at most 3 s) until `name`'s open count is `n`: a client's
    /// disconnect reaches the daemon a moment after the client closed.
    pub fn wait_open_count(&self, name: &str, n: u32) {
        let want = format!("Open count:        {n}");
        let t0 = Instant::now();
        while self.info_line(name, "Open count:") != want {
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "timed out waiting for open count {n} of {name}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Remove `name` once its last client's disconnect has arrived.
    pub fn remove_closed(&self, name: &str) {
        self.wait_open_count(name, 0);
        self.ok(&["remove", name]);
    }

    /// Run and require failure; returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(!o.status.success(), "dmkit {args:?} unexpectedly succeeded");
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(e.trim_end().lines().count(), 1, "error should be one line: {e}");
        e
    }

    pub fn create(&self, name: &str, table: &str) {
        let o = self.cli_in(&["create", name], table);
        assert!(
            o.status.success(),
            "create {name} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }

    /// Replace `name`'s table with `table` and make it live, as dmsetup's
    /// reload does it: load, suspend, resume.
    pub fn reload(&self, name: &str, table: &str) {
        self.ok(&["load", name, "--table", table]);
        self.ok(&["suspend", name]);
        self.ok(&["resume", name]);
    }

    /// `name`'s status line once it contains `part` (within `within`).
    pub fn wait_status(&self, name: &str, part: &str, within: Duration) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.ok(&["status", name]);
            if s.contains(part) {
                return s.trim().to_string();
            }
            assert!(t0.elapsed() < within, "{name}'s status has no '{part}': {s}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Start merging snapshot `snap` into `origin` as lvconvert --merge does:
    /// both suspended, the origin's table replaced by `merge_table`, the origin
    /// resumed (`snap` stays suspended).
    pub fn start_merge(&self, origin: &str, snap: &str, merge_table: &str) {
        self.ok(&["suspend", origin]);
        self.ok(&["suspend", snap]);
        self.ok(&["load", origin, "--table", merge_table]);
        self.ok(&["resume", origin]);
    }

    /// Flushes `stats NAME` reports for `file`.
    pub fn flushes(&self, name: &str, file: &Path) -> u64 {
        self.stat(name, file, "flushes")
    }

    /// FUA writes `stats NAME` reports for `file`.
    pub fn fua_writes(&self, name: &str, file: &Path) -> u64 {
        self.stat(name, file, "fua_writes")
    }

    /// The counter `key` of `file`'s line in `stats NAME`
    /// (`PATH flushes=N fua_writes=M`).
    fn stat(&self, name: &str, file: &Path, key: &str) -> u64 {
        let out = self.ok(&["stats", name]);
        let prefix = format!("{} ", file.display());
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no line for {} in stats:\n{out}", file.display()));
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("no {key}= in stats line: {line}"))
            .parse()
            .unwrap_or_else(|_| panic!("{key} is not a number: {line}"))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path("daemon.log")).unwrap_or_default()
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's resident memory now, in KiB (VmRSS).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Whether the daemon process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if !self.alive() {
            return; // already reaped (kill9): its pid may belong to someone else now
        }
        // SAFETY: sending SIGTERM to our own child process.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `cmd` with no descriptor but 0, 1 and 2: what the test harness (or the
/// shell that ran it) left open must not be taken for a leak of the program's,
/// which LVM reports at start.
pub fn only_std_fds(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: close_range is async-signal-safe and touches no memory; between
    // fork and exec the child only closes descriptors it does not use.
    unsafe {
        cmd.pre_exec(|| {
            libc::close_range(3, libc::c_uint::MAX, 0);
            Ok(())
        })
    }
}

/// `tests/door/NAME.c` built with the C compiler into the daemon's folder.
pub fn build_c(d: &Daemon, name: &str) -> PathBuf {
    let exe = d.dir.path(name);
    let src = format!("{}/tests/door/{name}.c", env!("CARGO_MANIFEST_DIR"));
    run(Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-lpthread"));
    exe
}

/// Require `tool` on PATH: a test that cannot find its tool fails (the test
/// command, ci/test.sh, installs every tool the suite uses).
pub fn need(tool: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "required tool '{tool}' is not installed (ci/install.sh installs it)"
    );
}

/// Require every tool of `tools` (see [`need`]).
pub fn need_all(tools: &[&str]) {
    tools.iter().for_each(|t| need(t));
}

/// The absolute path of tool `t` (for a guest's ORACLE_BINS); fails if missing.
pub fn tool_path(t: &str) -> String {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| format!("{d}/{t}"))
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| panic!("{t} not found (ci/install.sh installs it)"))
}

/// A file of `bytes` in `s`: sparse, or holding `pattern(seed)`.
pub fn image(s: &Scratch, name: &str, bytes: u64, seed: Option<u64>) -> PathBuf {
    let p = s.sparse(name, bytes);
    if let Some(seed) = seed {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&p).expect("open");
        f.write_all_at(&pattern(seed, bytes as usize), 0).expect("fill");
    }
    p
}

/// Run a command and require success; returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Deterministic pseudo-random bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    dmkit::rng::pattern(seed, len)
}

pub fn read_at(p: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(p).expect("open");
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, off).expect("read_at");
    b
}

// ---- Added for tests/thin_fs_crash.rs: crash helpers ----

impl Daemon {
    /// Kill the daemon with SIGKILL (no shutdown path runs: no final commit) and
    /// reap it. The scratch directory stays until the `Daemon` is dropped.
    pub fn kill9(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: sending SIGKILL to our own, not yet reaped, child process.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

/// Reproducible random offsets for model tests (dmkit's generator, state set
/// directly).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        dmkit::rng::step(&mut self.0)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Read a whole export of `size` bytes in 1 MiB requests.
pub fn read_all(c: &mut nbd::Client, size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(size as usize);
    let mut off = 0;
    while off < size {
        let n = (size - off).min(MIB);
        out.extend_from_slice(&c.read(off, n as usize));
        off += n;
    }
    out
}

/// Require `got == want`, naming the first differing byte and its sector.
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: differs from the model at byte {i} (sector {})", i / 512);
    }
}

/// (export, block, pattern seed) of every write attempted, in order, and how
/// many of them the last completed flush of every export covers.
pub type WriteLog = (Vec<(usize, usize, u64)>, usize);

/// A thread writing to a daemon until it is killed: see [`write_until_killed`].
pub struct Load {
    log: std::sync::Arc<std::sync::Mutex<WriteLog>>,
    thread: std::thread::JoinHandle<()>,
}

/// Write `bs`-byte blocks of `pattern(seed)` (seeds counting up from
/// `first_seed`) at random blocks below `nb` of `exports`, the export chosen by
/// `pick`, with a flush of every export after each 25 writes, until a request
/// fails: the daemon was killed.
pub fn write_until_killed(
    sock: PathBuf,
    exports: &[&str],
    pick: impl Fn(&mut Rng) -> usize + Send + 'static,
    nb: usize,
    bs: u64,
    mut rng: Rng,
    first_seed: u64,
) -> Load {
    let log: std::sync::Arc<std::sync::Mutex<WriteLog>> = Default::default();
    let l2 = log.clone();
    let exports: Vec<String> = exports.iter().map(|e| e.to_string()).collect();
    let thread = std::thread::spawn(move || {
        let mut c: Vec<nbd::Client> = exports.iter().map(|e| nbd::Client::connect(&sock, e)).collect();
        let mut seed = first_seed;
        for i in 0.. {
            let dev = pick(&mut rng);
            let b = rng.below(nb as u64) as usize;
            seed += 1;
            l2.lock().unwrap().0.push((dev, b, seed));
            if c[dev].try_call(nbd::WRITE, b as u64 * bs, &pattern(seed, bs as usize)) != Some(0) {
                return;
            }
            if i % 25 == 24 {
                let n = l2.lock().unwrap().0.len();
                for cl in c.iter_mut() {
                    if cl.try_call(nbd::FLUSH, 0, &[]) != Some(0) {
                        return;
                    }
                }
                l2.lock().unwrap().1 = n;
            }
        }
    });
    Load { log, thread }
}

impl Load {
    /// Wait until at least `n` writes are covered by a completed flush (at most
    /// `within`); false if they were not.
    pub fn wait_flushed(&self, n: usize, within: Duration) -> bool {
        let t0 = Instant::now();
        while self.log.lock().unwrap().1 < n {
            if t0.elapsed() > within || self.thread.is_finished() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Wait for the writer to stop (kill the daemon first); its log.
    pub fn finish(self) -> WriteLog {
        self.thread.join().expect("the writer thread panicked");
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

/// Fold `log` into `state` (each export's blocks as they must read): writes
/// the last flush covers become the state; what each block may hold instead
/// (the later writes) is returned, per export and block.
pub fn settle(state: &mut [Vec<Vec<u8>>], log: &WriteLog, bs: u64) -> Vec<Vec<Vec<Vec<u8>>>> {
    let mut allowed: Vec<Vec<Vec<Vec<u8>>>> = state.iter().map(|s| vec![Vec::new(); s.len()]).collect();
    for (i, &(dev, b, sd)) in log.0.iter().enumerate() {
        if i < log.1 {
            state[dev][b] = pattern(sd, bs as usize);
        } else {
            allowed[dev][b].push(pattern(sd, bs as usize));
        }
    }
    allowed
}

/// After a crash: every `bs` block of `got` holds its `state` or one of its
/// `allowed` later writes; `state` becomes what was read.
pub fn accept(got: &[u8], state: &mut [Vec<u8>], allowed: &[Vec<Vec<u8>>], bs: u64, what: &str) {
    for (b, blk) in got.chunks(bs as usize).enumerate() {
        assert!(
            blk == state[b].as_slice() || allowed[b].iter().any(|a| a == blk),
            "{what}: block {b} holds neither its flushed data nor a later write"
        );
        state[b] = blk.to_vec();
    }
}

/// fio's verify (random writes of 4 KiB–1 MiB, a fifth of them 512 KiB or more,
/// at QD16 over 32 MiB, crc32c) through
/// export `export` while device `below` is suspended and resumed every 60 ms:
/// asserts fio saw no error and that it ran across at least three cycles.
pub fn fio_verify_while_suspending(d: &Daemon, export: &str, below: &str) {
    use std::sync::atomic::AtomicBool;
    need("fio");
    let stop = AtomicBool::new(false);
    let cycles = std::thread::scope(|s| {
        let flipper = s.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(40));
                d.ok(&["suspend", below]);
                std::thread::sleep(Duration::from_millis(20));
                d.ok(&["resume", below]);
                n += 1;
            }
            n
        });
        let out = run(Command::new("fio")
            .arg("--name=verify")
            .arg("--ioengine=nbd")
            .arg(format!("--uri={}", d.uri(export)))
            .args([
                "--rw=randwrite",
                // 512 KiB and 1 MiB requests have their owned-buffer hooks
                // run on the engine's workers (crypt's decryption, xor's)
                "--bssplit=4k/30:16k/20:64k/30:512k/10:1m/10",
                "--iodepth=16",
                "--size=32M",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--verify_state_save=0",
            ]));
        stop.store(true, Ordering::SeqCst);
        let n = flipper.join().expect("suspend thread");
        assert!(out.contains("err= 0"), "fio through {export}: {out}");
        n
    });
    assert!(cycles >= 3, "only {cycles} suspend/resume cycles during the run");
}
